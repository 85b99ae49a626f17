"""Data-parallel training: two ranks through torchrun on the CPU (gloo on 127.0.0.1).

An uninterrupted two-process run is the baseline here; the same job stopped by SIGTERM (both ranks
at one checkpoint), resumed, killed like a power cut (a SIGKILL of `lodger resume`; torchrun and the
ranks die with it) and resumed again ends bitwise equal to it; resuming with another number of
processes is refused before anything starts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from helpers import (TOTAL_STEPS, WORLD, checkpoint_dirs, describe, eval_losses, event_kinds,
                     final_adapter_bytes, killed_by_sigkill, lodger_env, run_dir_of, run_lodger, show,
                     stale_entries, start_lodger, train_records, wait_until)
from lodger.owner.runlock import is_locked



def ckpt(step: int) -> str:
    return f"step-{step:08d}"


def _workers_of(run_id: str) -> list[int]:
    """Live processes training ``run_id`` (torchrun and its ranks: their command lines name it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"_worker" in argv and run_id.encode() in argv and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def _killed_ddp(tmp_path_factory: pytest.TempPathFactory, ddp_job: Path) -> dict:
    """The two-rank job, stopped by SIGTERM once step 4 is committed, then resumed and SIGKILLed
    (`lodger resume` and, through it, torchrun and both ranks) once step 12 is committed: one run
    for both ways a run is stopped, since each start of two ranks costs seconds of imports."""
    home = tmp_path_factory.mktemp("ddp_killed_home")
    env = lodger_env(home)
    logs = home.parent / "ddp_killed_logs"
    proc = start_lodger(["run", ddp_job, "--quiet"], env, log_dir=logs)
    try:
        run_id = proc.run_id()
        folder = run_dir_of(run_id, env)
        wait_until(lambda: ckpt(4) in checkpoint_dirs(folder), 120, proc.proc, what="checkpoint step 4",
                   output=proc)
        proc.kill(signal.SIGTERM)
        termed = proc.wait()
    finally:
        proc.close()
    sigterm = {"exit": termed, "output": describe(proc), "run": show(run_id, env)["run"],
               "committed": checkpoint_dirs(folder), "workers": _workers_of(run_id)}

    proc = start_lodger(["resume", run_id, "--quiet"], env, log_dir=logs)
    try:
        wait_until(lambda: ckpt(12) in checkpoint_dirs(folder), 120, proc.proc, what="checkpoint step 12",
                   output=proc)
        tree = _workers_of(run_id)
        proc.kill(signal.SIGKILL)  # `lodger resume`, which became the rank supervisor
        assert len(tree) == 2 + WORLD, f"supervisor, torchrun and two ranks expected: {tree}"
        assert killed_by_sigkill(proc.wait()), describe(proc)
        # torchrun and each rank asked the kernel to die with their parent: nothing trains on as an orphan.
        wait_until(lambda: not _workers_of(run_id), 60, what="both ranks to die with torchrun")
        wait_until(lambda: not is_locked(folder), 60, what="the run lock to be free")
    finally:
        proc.close()
    committed = checkpoint_dirs(folder)
    assert committed and ckpt(TOTAL_STEPS) not in committed, f"killed too late to test anything: {committed}"
    return {"home": home, "run_id": run_id, "committed": committed, "sigterm": sigterm}


@pytest.fixture
def killed_ddp(_killed_ddp, lodger_home: Path) -> tuple[str, Path, list[str]]:
    """(run id, run folder, committed checkpoints) of the killed run, copied into this test's home."""
    run_id = _killed_ddp["run_id"]
    shutil.copytree(_killed_ddp["home"], lodger_home, dirs_exist_ok=True)
    return run_id, lodger_home / "runs" / run_id, _killed_ddp["committed"]


def test_two_rank_run_trains_once_and_rank_0_commits_every_ranks_state(ddp_baseline):
    folder = ddp_baseline["dir"]
    assert [r["step"] for r in ddp_baseline["records"]] == list(range(1, TOTAL_STEPS + 1))
    # the global batch is both ranks' examples: 2 x batch_size x grad_accum per step
    log = (folder / "log.txt").read_text()
    assert log.count(f"step 1/{TOTAL_STEPS} ") == 1, "only rank 0 writes the log"
    assert "x 2 processes" in log
    newest = folder / "checkpoints" / ckpt(TOTAL_STEPS)
    manifest = json.loads((newest / "MANIFEST.json").read_text())
    assert manifest["world_size"] == WORLD
    assert {"rng.safetensors", "rng-rank-1.json", "state.json"} <= set(manifest["files"])
    rank1 = json.loads((newest / "rng-rank-1.json").read_text())
    assert set(rank1) >= {"python", "numpy", "tensors"} and "torch_cpu" in rank1["tensors"]
    info = show(ddp_baseline["run_id"], ddp_baseline["env"])
    assert info["run"]["status"] == "finished" and info["run"]["step"] == TOTAL_STEPS
    started = next(e for e in info["events"] if e["kind"] == "started")
    assert started["data"].get("world_size") == WORLD, started


def test_sigterm_then_a_power_cut_of_two_rank_run_then_resume_is_bitwise_equal(killed_ddp, ddp_baseline):
    run_id, folder, committed = killed_ddp
    result = run_lodger(["resume", run_id, "--quiet"])
    assert result.returncode == 0, describe(result)
    records = train_records(folder)
    assert [r["step"] for r in records] == list(range(1, TOTAL_STEPS + 1)), \
        f"metrics.jsonl must hold each step exactly once, in order: {[r['step'] for r in records]}"
    for mine, theirs in zip(records, ddp_baseline["records"]):
        assert mine == theirs, f"step {theirs['step']} differs from the uninterrupted two-rank run"
    assert eval_losses(folder) == ddp_baseline["evals"]
    assert final_adapter_bytes(folder) == ddp_baseline["adapter"], "final adapter bytes differ"
    assert stale_entries(folder) == []
    info = show(run_id)
    assert info["run"]["status"] == "finished"
    assert event_kinds(info).count("resumed") == 2  # after the SIGTERM, and after the SIGKILL
    # packed ([training] packing = "auto"): each rank trained its share of every step's packs
    segments = json.loads((folder / "provenance.json").read_text())["segments"]
    assert [s["data"]["packing"]["mode"] for s in segments] == ["segments"] * 3, segments


@pytest.mark.parametrize("other", [1, 3])
def test_resume_with_another_world_size_is_refused_and_changes_nothing(killed_ddp, other):
    run_id, folder, committed = killed_ddp
    before = show(run_id)
    metrics = (folder / "metrics.jsonl").read_bytes()
    result = run_lodger(["resume", run_id, "--world-size", str(other)])
    assert result.returncode != 0, describe(result)
    message = result.stderr
    assert f"written by {WORLD} training process" in message and f"would use {other}" in message, message
    assert f"--world-size {WORLD}" in message, "the error names the fix"
    assert "Traceback" not in message
    assert checkpoint_dirs(folder) == committed
    assert (folder / "metrics.jsonl").read_bytes() == metrics
    after = show(run_id)
    assert after["run"]["status"] == before["run"]["status"]
    assert len(after["events"]) == len(before["events"]), "a refused resume records nothing"
    assert not os.path.exists(folder / "adapter")


def test_sigterm_stops_both_ranks_at_one_checkpoint(_killed_ddp):
    """The first part of the shared run (its resume and the SIGKILL are the test above's)."""
    stopped = _killed_ddp["sigterm"]
    assert stopped["exit"] == 0, stopped["output"]  # like one process: a checkpoint, then exit 0
    assert stopped["run"]["status"] == "interrupted", stopped["run"]
    assert 4 <= stopped["run"]["step"] < TOTAL_STEPS, stopped["run"]
    assert stopped["committed"][-1] == ckpt(stopped["run"]["step"]), "both ranks stopped at the step rank 0 chose, saved"
    assert stopped["workers"] == [], "torchrun and both ranks exited with `lodger run`"
