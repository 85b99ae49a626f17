"""Faults: hostile files. Each is put where lodger will meet it, then the real command runs:

- a symbolic link in a run folder (log.txt) or in a checkpoint (its weights) pointing outside
  $LODGER_HOME, and a run folder that is itself such a link: `resume` and `export` refuse before
  touching anything, naming the link and the fix; nothing is written through the link;
- a model folder whose config.json asks for its own code (``auto_map``, a model_type transformers
  does not have): refused before anything loads, and the code in the folder never runs;
- a truncated GGUF file as the model: refused, naming the file and what is wrong, no traceback;
- a data path that is a FIFO or a character device, in a job and in `lodger data add`: refused at
  once (a FIFO would block the read forever, /dev/zero never end);
- a single line of 100 MiB (fast) and of 2 GiB (bench only), both sparse files of NUL bytes: the
  line is refused by number and size after 64 MiB, memory stays bounded;
- 10^6 tiny lines (bench only): the run finishes; its peak memory and time are printed.

The refusals run through tests/e2e/cli_driver.py (one process forked per case from one that
imported the CLI once), the rest through the `lodger` script.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fixtures_lib import write_chat_jsonl, write_text_jsonl
from faults_helpers import expensive, run_measured
from helpers import checkpoint_dirs, describe, lodger_env, write_job

pytestmark = pytest.mark.faults
DRIVER = Path(__file__).resolve().parent / "cli_driver.py"
MIB = 2**20


@dataclass
class Case:
    args: list
    words: list[str]          # what the error must say
    home: Path
    snapshot: object = None   # what must be unchanged afterwards, taken before and after the command
    before: object = None
    result: subprocess.CompletedProcess | None = None


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() and not p.is_symlink() else b"")
            for p in sorted(folder.rglob("*"))}


def _ledger_rows(home: Path) -> tuple:
    """Every table's schema and every row of it, as SQL (events, runs, metrics, the queue, datasets,
    the chain head...): an unchanged ledger has the same, where counting events would miss a row
    updated, or one written outside the chain (a run's pid, say)."""
    import sqlite3

    if not (home / "ledger.db").exists():
        return ()
    db = sqlite3.connect(f"file:{home / 'ledger.db'}?mode=ro", uri=True)
    try:
        return tuple(db.iterdump())
    finally:
        db.close()


def _gguf(path: Path, cut: int) -> Path:
    """A small, well-formed GGUF file (llama architecture, two tensors) less its last ``cut`` bytes."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones((32,), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - cut])
    return path


def _long_line_file(path: Path, good: Path, size: int) -> Path:
    """Three good lines, then one line of ``size`` NUL bytes: a sparse file, no disk used for it."""
    lines = good.read_bytes().splitlines(keepends=True)[:3]
    with open(path, "wb") as fh:
        fh.write(b"".join(lines))
        fh.truncate(fh.tell() + size)
    return path


def _home(root: Path, name: str, killed: Path | None = None) -> Path:
    home = root / name / "home"
    if killed is not None:
        shutil.copytree(killed, home)
    else:
        home.mkdir(parents=True, mode=0o700)
    return home


def _build(root: Path, model: Path, killed: tuple[Path, str]) -> dict[str, Case]:
    src, run_id = killed
    train = write_chat_jsonl(root / "train.jsonl", 16, seed=0)
    outside = root / "outside"
    outside.mkdir()
    cases: dict[str, Case] = {}

    home = _home(root, "link_in_run", src)  # log.txt -> a file of the owner's, outside the home
    victim = outside / "bashrc"
    victim.write_text("# the owner's file\n")
    log = home / "runs" / run_id / "log.txt"
    log.unlink()
    log.symlink_to(victim)
    cases["symlink_in_a_run_folder"] = Case(["resume", run_id], [str(log), f"a symbolic link to {victim}",
                                                                 "outside $LODGER_HOME", f"rm {log}"], home,
                                            lambda v=victim, h=home: (v.read_bytes(), _ledger_rows(h)))

    home = _home(root, "link_in_checkpoint", src)  # the newest checkpoint's weights -> outside
    step = home / "runs" / run_id / "checkpoints" / checkpoint_dirs(home / "runs" / run_id)[-1]
    secret = outside / "secret.bin"
    shutil.copyfile(step / "adapter_model.safetensors", secret)
    (step / "adapter_model.safetensors").unlink()
    (step / "adapter_model.safetensors").symlink_to(secret)
    dest = root / "link_in_checkpoint" / "export"
    cases["symlink_in_a_checkpoint_export"] = Case(["export", run_id, dest], [f"a symbolic link to {secret}",
                                                                              "outside $LODGER_HOME"], home,
                                                   lambda d=dest, h=home: (d.exists(), _ledger_rows(h)))

    home = _home(root, "run_folder_link", src)  # the run folder itself moved out and linked back
    folder, moved = home / "runs" / run_id, outside / run_id
    shutil.move(str(folder), moved)
    folder.symlink_to(moved)
    cases["run_folder_is_a_symlink"] = Case(["resume", run_id], [f"its folder {folder} is a symbolic link to {moved}",
                                                                 "Move the folder back"], home,
                                            lambda m=moved, h=home: (_tree(m), _ledger_rows(h)))

    evil = shutil.copytree(model, root / "evil-model")  # config.json asks for the folder's own code
    config = json.loads((evil / "config.json").read_text())
    config.update(model_type="evilmodel", auto_map={"AutoConfig": "evil.Config", "AutoModelForCausalLM": "evil.Model"})
    (evil / "config.json").write_text(json.dumps(config))
    marker = outside / "the-model-code-ran"
    (evil / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    home = _home(root, "remote_code")
    job = write_job(root / "remote_code" / "job.toml", model=evil, train=train, steps=2)
    cases["model_asks_for_remote_code"] = Case(["run", job], ["auto_map", "evilmodel",
                                                              "never runs a model's own code"], home,
                                               lambda m=marker, h=home: (m.exists(), _ledger_rows(h)))

    broken = _gguf(root / "truncated.gguf", cut=1000)
    home = _home(root, "truncated_gguf")
    job = write_job(root / "truncated_gguf" / "job.toml", model=broken, train=train, steps=2)
    cases["truncated_gguf"] = Case(["run", job], [str(broken), "is not a usable GGUF file", "truncated"], home,
                                   lambda h=home: _ledger_rows(h))

    fifo = root / "pipe.jsonl"
    os.mkfifo(fifo)
    for name, path in (("fifo", fifo), ("device", Path("/dev/zero"))):
        home = _home(root, f"data_{name}_job")
        job = write_job(root / f"data_{name}_job" / "job.toml", model=model, train=path, steps=2)
        cases[f"data_is_a_{name}_in_a_job"] = Case(["run", job], ["[data] train", str(path),
                                                                  "not a regular file", "JSONL"], home,
                                                   lambda h=home: _ledger_rows(h))
        home = _home(root, f"data_{name}_add")
        kind = "a named pipe (FIFO)" if name == "fifo" else "a character device"
        cases[f"data_is_a_{name}_in_data_add"] = Case(["data", "add", path, "--name", "d", "--license", "MIT",
                                                       "--owner", "me"], [f"is {kind}, not a regular file"], home,
                                                      lambda h=home: _ledger_rows(h))

    long = _long_line_file(root / "long.jsonl", train, 100 * MIB)
    home = _home(root, "long_line")
    job = write_job(root / "long_line" / "job.toml", model=model, train=long, steps=2)
    cases["a_100_mib_line"] = Case(["run", job], [f"{long}:4: the line is {100 * MIB:,} bytes, over the "
                                                  f"{64 * MIB:,}"], home, lambda h=home: _ledger_rows(h))
    for case in cases.values():
        case.before = case.snapshot()
    return cases


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, tiny_model_dir: Path, _killed_home) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("hostile_files")
    cases = _build(root, tiny_model_dir, _killed_home)
    runs = [{"args": [str(a) for a in c.args], "env": lodger_env(c.home), "cwd": str(c.home.parent),
             "stdout": str(c.home.parent / "out"), "stderr": str(c.home.parent / "err")} for c in cases.values()]
    (root / "cases.json").write_text(json.dumps(runs))
    driver = subprocess.run([sys.executable, str(DRIVER), str(root / "cases.json")], env=lodger_env(root / "unused"),
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1800)
    assert driver.returncode == 0, describe(driver)
    codes = json.loads(driver.stdout.strip().splitlines()[-1])
    for case, run, code in zip(cases.values(), runs, codes):
        case.result = subprocess.CompletedProcess(run["args"], code, Path(run["stdout"]).read_text(errors="replace"),
                                                  Path(run["stderr"]).read_text(errors="replace"))
    return cases


def _held(case: Case) -> None:
    result = case.result
    assert result.returncode != 0, describe(result)
    assert "Traceback" not in result.stdout + result.stderr, describe(result)
    error = "\n".join(line for line in result.stderr.splitlines() if line.startswith("error:") or line.startswith("  "))
    for words in case.words:
        assert words in error, f"{words!r} not in the error:\n{describe(result)}"
    assert not (case.home / "logs").exists(), f"treated as a crash:\n{describe(result)}"
    assert case.snapshot() == case.before, "something was written, or read through the link"


def test_a_symlink_in_a_run_folder_pointing_outside_is_refused_and_nothing_is_written_through_it(hostile):
    """resume names log.txt -> outside and the fix; the file it points at and the ledger are unchanged"""
    _held(hostile["symlink_in_a_run_folder"])


def test_a_symlink_in_a_checkpoint_pointing_outside_is_refused_by_export(hostile):
    """export names the linked weights; no export folder appears; the ledger is unchanged"""
    _held(hostile["symlink_in_a_checkpoint_export"])


def test_a_run_folder_that_is_a_symlink_outside_is_refused_and_left_as_it_was(hostile):
    """resume names the link, its target and the fix; every file under the target is unchanged"""
    _held(hostile["run_folder_is_a_symlink"])


def test_a_model_asking_for_its_own_code_is_refused_and_its_code_never_runs(hostile):
    """auto_map with an unknown model_type: refused before loading; the folder's evil.py did not run"""
    _held(hostile["model_asks_for_remote_code"])


def test_a_model_of_a_known_architecture_with_an_auto_map_loads_transformers_own_code(tiny_model_dir, tmp_path):
    """auto_map beside model_type llama: resolved (transformers' Llama), the folder's code never imported"""
    from lodger.model import resolve_source

    folder = shutil.copytree(tiny_model_dir, tmp_path / "mapped")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "mapped_code.Model"}
    (folder / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    (folder / "mapped_code.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    from transformers import AutoConfig

    assert resolve_source(str(folder)).kind == "hf"
    assert AutoConfig.from_pretrained(str(folder), local_files_only=True).model_type == "llama"
    assert not marker.exists()


def test_a_truncated_gguf_model_is_refused_naming_the_file(hostile):
    """the file, 'not a usable GGUF file', the reader's reason; no traceback, no crash log"""
    _held(hostile["truncated_gguf"])


@pytest.mark.parametrize("case", ["data_is_a_fifo_in_a_job", "data_is_a_device_in_a_job",
                                  "data_is_a_fifo_in_data_add", "data_is_a_device_in_data_add"])
def test_a_data_path_that_is_a_fifo_or_a_device_is_refused_at_once(hostile, case):
    """no read that blocks or never ends: the path and what it is are named; nothing registered"""
    _held(hostile[case])


def test_a_100_mib_line_is_refused_by_number_and_size(hostile):
    """the line past 64 MiB is named with its size; nothing written"""
    _held(hostile["a_100_mib_line"])


@expensive
def test_a_2_gib_line_is_refused_with_bounded_memory(tiny_model_dir, tmp_path):
    """a sparse 2 GiB line: refused by number and size, peak memory under 1.5 GiB (it holds 64 MiB of it)"""
    train = write_chat_jsonl(tmp_path / "train.jsonl", 16, seed=0)
    long = _long_line_file(tmp_path / "long.jsonl", train, 2 * 2**30)
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=long, steps=2)
    result, peak, seconds = run_measured(["run", job], lodger_env(tmp_path / "home"))
    print(f"\n2 GiB line: refused in {seconds:.1f} s, peak {peak:.0f} MiB")
    assert result.returncode == 2 and "Traceback" not in result.stderr, describe(result)
    assert f"{long}:4: the line is {2 * 2**30:,} bytes" in result.stderr, describe(result)
    assert peak < 1536, f"peak {peak:.0f} MiB for a refused line"


@expensive
def test_a_million_tiny_lines_train_with_bounded_memory(tiny_model_dir, tmp_path):
    """10^6 lines of ~20 bytes: the run finishes; peak memory (stated) under 2 GiB, about 1 KiB a line"""
    train = tmp_path / "million.jsonl"
    with open(train, "w") as fh:
        for n in range(10**6):
            fh.write(json.dumps({"text": f"red cat {n % 97}"}) + "\n")
    evals = write_text_jsonl(tmp_path / "eval.jsonl", 4, seed=1)
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=train, eval=evals, steps=2, eval_every=None)
    result, peak, seconds = run_measured(["run", job, "--quiet"], lodger_env(tmp_path / "home"), timeout=1800)
    print(f"\n10^6 lines ({train.stat().st_size / MIB:.0f} MiB): trained in {seconds:.0f} s, peak {peak:.0f} MiB")
    assert result.returncode == 0, describe(result)
    assert peak < 2048, f"peak {peak:.0f} MiB for 10^6 short lines"
