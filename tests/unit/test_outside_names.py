"""Names read from outside (checkpoint manifests, remote storage) are plain names, never paths, and
`lodger sync` takes nothing from a storage folder whose job is not the one submitted.

Remote storage is faked as in test_remote.py: a folder laid out as the remote worker leaves it,
with no Ray. `lodger sync` itself runs as a real process.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lodger.checkpoint import MANIFEST, CheckpointStore, _manifest_hash
from lodger.errors import CheckpointError
from lodger.home import run_dir
from lodger.ledger import Ledger

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from helpers import describe, lodger_env, run_lodger  # noqa: E402
from lodger.ledger.values import NewRun

BAD_NAMES = ["../../outside", "../outside", "/tmp/lodger-absolute-outside", "sub/file", "..", ".", "",
             "nul\x00byte", "back\\slash", MANIFEST]


def _forge(step_dir: Path, names: list[str]) -> None:
    """Rewrite a committed checkpoint's manifest so that it lists ``names`` too (with a valid own
    hash, as whoever can write the folder can make it)."""
    manifest = json.loads((step_dir / MANIFEST).read_bytes())
    for name in names:
        data = f"written by a forger as {name!r}".encode()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest["manifest_sha256"] = _manifest_hash(manifest)
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_manifest_that_names_a_path_makes_its_checkpoint_damaged(tmp_path, name):
    store = CheckpointStore(tmp_path / "checkpoints")
    good = store.save(2, {"state.json": b"{}"})
    bad = store.save(4, {"state.json": b"{}"})
    _forge(bad, [name])
    with pytest.raises(CheckpointError, match="not a plain file name"):
        store.load(bad)
    damaged = []
    assert store.latest_good(lambda path, why, aside: damaged.append(why)).path == good
    assert len(damaged) == 1 and "not a plain file name" in damaged[0]


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and mtime (a file written over shows as changed)."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def _remote_run(tmp_path: Path, run_id: str, *, job_sha256: str | None = "recorded") -> tuple[Path, Path]:
    """A remote run as the worker leaves it in storage, and its local row (as `lodger submit` records it)."""
    storage = tmp_path / "storage"
    job = b'[checkpoints]\nkeep_last = 3\n'
    (storage / run_id).mkdir(parents=True)
    (storage / run_id / "job.toml").write_bytes(job)
    remote_home = storage / run_id / "home"
    folder = remote_home / "runs" / run_id
    folder.mkdir(parents=True)
    info = {"address": "http://127.0.0.1:1", "dir": str(storage / run_id), "python": sys.executable,
            "cost_per_gpu_hour": 0.0}
    if job_sha256 is not None:
        info["job_sha256"] = hashlib.sha256(job).hexdigest()
    run_dir(run_id).mkdir(parents=True)
    with Ledger() as ledger:
        ledger.create_run(NewRun(run_id, name="r", model="m", method="lora", job_hash="h", job_toml="",
                          total_steps=24, pid=None))
        ledger.update_run(run_id, target="t", remote_job_id=f"{run_id}-s0", remote=json.dumps(info))
    return storage, folder


def test_sync_refuses_a_remote_checkpoint_whose_manifest_names_paths_and_writes_nothing_outside(tmp_path,
                                                                                              lodger_home):
    run_id = "remote-traversal"
    storage, folder = _remote_run(tmp_path, run_id)
    store = CheckpointStore(folder / "checkpoints", keep_last=3)
    store.save(2, {"state.json": b"{}"})
    forged = store.save(4, {"state.json": b"{}"})
    names = ["../../outside", "../../../../outside", str(tmp_path / "absolute-outside")]
    _forge(forged, names)
    for name in names:  # the files exist, so a sync that followed the names would find them
        (forged / name).write_bytes(f"written by a forger as {name!r}".encode())
    before = _files(tmp_path)

    result = run_lodger(["sync", run_id], lodger_env(), timeout=300)

    assert result.returncode == 0 and "Traceback" not in result.stderr, describe(result)
    local = run_dir(run_id)
    assert sorted(p.name for p in (local / "checkpoints").glob("step-*")) == ["step-00000002"]
    after = _files(tmp_path)
    written = [p for p, seen in after.items() if before.get(p) != seen]
    ledger = [str(lodger_home / f"ledger.db{suffix}") for suffix in ("", "-wal", "-shm")]
    outside = [p for p in written if not Path(p).is_relative_to(local) and p not in ledger]
    assert outside == [], outside


def test_sync_refuses_a_job_changed_in_storage_since_submission(tmp_path, lodger_home):
    run_id = "remote-tampered"
    storage, folder = _remote_run(tmp_path, run_id)
    CheckpointStore(folder / "checkpoints", keep_last=3).save(2, {"state.json": b"{}"})
    job = storage / run_id / "job.toml"
    job.write_bytes(job.read_bytes() + b'[data]\ntrain = "/home/someone/secret.jsonl"\n')

    result = run_lodger(["sync", run_id], lodger_env(), timeout=300)

    assert result.returncode == 4 and "Traceback" not in result.stderr, describe(result)
    assert str(job) in result.stderr and "was changed in storage" in result.stderr, describe(result)
    assert not (run_dir(run_id) / "checkpoints").exists()  # nothing copied
    status = run_lodger(["status"], lodger_env(), timeout=300)  # other runs stay visible; this one warned
    assert status.returncode == 0 and f"warning: {run_id}" in status.stderr, describe(status)

    os.remove(job)  # a job gone from storage is refused too
    result = run_lodger(["sync", run_id], lodger_env(), timeout=300)
    assert result.returncode == 4 and "cannot read the job" in result.stderr, describe(result)


def test_sync_copies_from_storage_whose_job_matches_and_skips_links_and_fifos(tmp_path, lodger_home):
    run_id = "remote-intact"
    storage, folder = _remote_run(tmp_path, run_id)
    CheckpointStore(folder / "checkpoints", keep_last=3).save(2, {"state.json": b"{}"})
    secret = tmp_path / "secret.txt"
    secret.write_text("the owner's own file")
    (folder / "log.txt").symlink_to(secret)  # would copy a file of this machine into the run
    os.mkfifo(folder / "metrics.jsonl")  # would block the sync forever
    (folder / "adapter").mkdir()
    (folder / "adapter" / "adapter_config.json").write_text("{}")
    (folder / "adapter" / "link").symlink_to(secret)

    result = subprocess.run([sys.executable, "-m", "lodger.cli.main", "sync", run_id], env=lodger_env(),
                            capture_output=True, text=True, timeout=300)

    assert result.returncode == 0, describe(result)
    local = run_dir(run_id)
    assert sorted(p.name for p in (local / "checkpoints").glob("step-*")) == ["step-00000002"]
    assert not (local / "log.txt").exists() and not (local / "metrics.jsonl").exists()
    assert sorted(p.name for p in (local / "adapter").iterdir()) == ["adapter_config.json"]
