"""Private by default: $LODGER_HOME and everything lodger creates under it are the owner's alone
(folders 0700, files 0600), and a home left readable by others is tightened once, with a notice."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from helpers import describe, lodger_env, run_lodger, write_job


def _mode(path: Path) -> str:
    return oct(stat.S_IMODE(os.lstat(path).st_mode))


def _loose(home: Path) -> list[str]:
    """Every entry under ``home`` (itself included) that is not owner-only: 0700 folders, 0600 files."""
    found = []
    for path in [home, *home.rglob("*")]:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            continue
        wanted = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
        if stat.S_IMODE(st.st_mode) != wanted:
            found.append(f"{path.relative_to(home.parent)} {oct(stat.S_IMODE(st.st_mode))}")
    return found


def test_a_run_in_a_new_home_leaves_nothing_readable_by_other_users(tmp_path: Path, tiny_model_dir: Path,
                                                                    chat_data: dict[str, Path]) -> None:
    home = tmp_path / "new-home"  # lodger creates it
    env = lodger_env(home)
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=chat_data["train"], eval=chat_data["eval"],
                    steps=4, every_steps=2, eval_every=2)
    result = run_lodger(["run", job, "--quiet"], env)
    assert result.returncode == 0, describe(result)
    assert "readable by other users" not in result.stderr  # a new home needs no tightening
    run = home / "runs" / result.stdout.split()[1]
    assert _mode(home) == oct(0o700) and _mode(home / "ledger.db") == oct(0o600)
    assert _mode(home / "cache" / "tokens") == oct(0o700)
    tokens = list((home / "cache" / "tokens").iterdir())
    assert tokens and all(_mode(p) == oct(0o600) for p in tokens)
    assert (run / "checkpoints").is_dir() and (run / "metrics.jsonl").is_file() and (run / "lock").is_file()
    assert _loose(home) == []  # the ledger's -wal and -shm, logs, checkpoints, control files: all of it


def test_an_existing_loose_home_is_tightened_once_with_one_line_on_stderr(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from lodger.ledger import Ledger
    from lodger.ledger.values import NewRun

    home = tmp_path / "old-home"
    monkeypatch.setenv("LODGER_HOME", str(home))
    with Ledger() as ledger:  # a ledger that knows r1: one that did not would be refused (ledger/known.py)
        ledger.create_run(NewRun("r1", "job", "/models/tiny", "lora", "h", "[method]\nkind = \"lora\"\n", 8))
    (home / "runs" / "r1" / "checkpoints").mkdir(parents=True)
    (home / "runs" / "r1" / "metrics.jsonl").write_text("{}\n")
    os.chmod(home / "ledger.db", 0o644)
    os.chmod(home / "runs" / "r1" / "metrics.jsonl", 0o664)
    for folder in (home, home / "runs", home / "runs" / "r1", home / "runs" / "r1" / "checkpoints"):
        os.chmod(folder, 0o755)
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("not lodger's")
    os.chmod(outside, 0o644)
    (home / "runs" / "link").symlink_to(outside)  # a link is not followed

    first = run_lodger(["ls"], lodger_env(home))
    assert first.returncode == 0, describe(first)
    notice = [line for line in first.stderr.splitlines() if "readable by other users" in line]
    assert len(notice) == 1 and str(home) in notice[0] and "0755" in notice[0], describe(first)
    assert _loose(home) == []
    assert _mode(outside) == oct(0o644)

    again = run_lodger(["ls"], lodger_env(home))
    assert again.returncode == 0 and "readable by other users" not in again.stderr, describe(again)
