"""Faults: a full disk during a checkpoint write, a ledger write and an export.

The run's whole $LODGER_HOME lives on a tmpfs of 16 MiB mounted for this module (faults_helpers:
a real file system that returns ENOSPC). One run of the standard job tells the story, each fault
frozen at a named point (``LODGER_FAULT=name@N:stop``), the disk filled, the process let go:

1. the run is writing its step-8 checkpoint when the disk fills: a clear error naming the
   checkpoint, the space it needs and what is free; step-4 stays committed and verifies; no
   half-written folder is left taking space; `lodger audit` is clean;
2. resumed, it commits step 8 again and the disk fills as the ledger records it: the error names
   ledger.db; the ledger rolled the write back whole (audit clean);
3. resumed once space is free, it finishes, bitwise equal to the uninterrupted baseline, the
   ledger completed from the run folder;
4. an export into the full disk fails naming the folder and what it needs, leaves nothing there;
   with space freed the same export succeeds.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from faults_helpers import audit, cont, fill, free, no_traceback, small_disk, wait_stopped
from helpers import (checkpoint_dirs, describe, eval_losses, final_adapter_bytes, lodger_env, run_lodger, stale_entries,
                     start_lodger, train_records)

pytestmark = pytest.mark.faults


@dataclass
class Phase:
    result: object
    checkpoints: list[str]
    stale: list[str]
    audit: object = None
    extra: dict = field(default_factory=dict)


def _frozen_then_full(args, env, disk: Path, fault: str, logs: Path):
    """Start `lodger ARGS` frozen at ``fault``, fill the disk, let it go on; its completed run."""
    proc = start_lodger(args, lodger_env(env["LODGER_HOME"], LODGER_FAULT=fault), logs)
    try:
        wait_stopped(proc.proc.pid)
        fill(disk)
        cont(proc.proc.pid)
        proc.wait(timeout=300)
    finally:
        proc.close()
    return proc


@pytest.fixture(scope="module")
def story(tmp_path_factory, standard_job: Path, baseline):
    root = tmp_path_factory.mktemp("full_disk")
    logs = root / "logs"
    with small_disk(root / "disk") as disk:
        home = disk / "home"
        home.mkdir(mode=0o700)
        env = lodger_env(home)
        phases: dict[str, Phase] = {}
        # 1. the second checkpoint (step 8): its first tensor file written, then the disk is full
        proc = _frozen_then_full(["run", standard_job, "--quiet"], env, disk, "after_tensors@4:stop", logs)
        run_id = proc.stdout().split()[1]
        folder = home / "runs" / run_id
        phase = Phase(proc, checkpoint_dirs(folder), stale_entries(folder))
        free(disk)
        phase.audit = audit(home)
        phase.extra["verifies"] = _verifies(folder, phase.checkpoints)
        phases["checkpoint"] = phase
        # 2. resumed from step 4: step 8 commits, then the ledger write finds the disk full
        proc = _frozen_then_full(["resume", run_id, "--quiet"], env, disk, "checkpoint_before_ledger@1:stop", logs)
        phase = Phase(proc, checkpoint_dirs(folder), stale_entries(folder))
        free(disk)
        phase.audit = audit(home)
        phase.extra["recorded_steps"] = _recorded_checkpoints(home, run_id)
        phases["ledger"] = phase
        # 3. space is back: resume finishes the run
        result = run_lodger(["resume", run_id], env)
        phase = Phase(result, checkpoint_dirs(folder), stale_entries(folder), audit(home))
        phase.extra["records"] = train_records(folder)
        phase.extra["evals"] = eval_losses(folder)
        phase.extra["adapter"] = final_adapter_bytes(folder) if (folder / "adapter").is_dir() else None
        phase.extra["recorded_steps"] = _recorded_checkpoints(home, run_id)
        phases["resume"] = phase
        # 4. an export into the full disk, then with room
        dest = disk / "export"
        fill(disk)
        result = run_lodger(["export", run_id, dest], env)
        phase = Phase(result, [], sorted(p.name for p in disk.iterdir() if p.name != "filler.bin" and p.name != "home"))
        free(disk)
        phase.extra["again"] = run_lodger(["export", run_id, dest], env)
        phase.extra["exported"] = sorted(p.name for p in dest.iterdir()) if dest.is_dir() else []
        phase.audit = audit(home)
        phases["export"] = phase
        yield {"run_id": run_id, "home": home, "disk": disk, "phases": phases, "baseline": baseline}


def _verifies(folder: Path, names: list[str]) -> list[str]:
    from lodger.checkpoint import CheckpointStore

    store = CheckpointStore(folder / "checkpoints", keep_last=2)
    return [name for name in names if store.load(folder / "checkpoints" / name).step]


def _recorded_checkpoints(home: Path, run_id: str) -> list[int]:
    with sqlite3.connect(f"file:{home / 'ledger.db'}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT data FROM events WHERE run_id=? AND kind='checkpoint' ORDER BY seq", (run_id,))
        return [json.loads(r[0])["step"] for r in rows]


def _error(result) -> str:
    text = result.stderr() if callable(result.stderr) else result.stderr
    return "\n".join(line for line in text.splitlines() if line.startswith("error:"))


def test_full_disk_during_a_checkpoint_write_keeps_the_previous_one_and_says_what_it_needs(story):
    """error names the checkpoint, the space needed and free; step 4 verifies; nothing half-written; audit clean"""
    phase, run_id = story["phases"]["checkpoint"], story["run_id"]
    assert phase.result.proc.returncode == 1, describe(phase.result)
    assert no_traceback(phase.result), describe(phase.result)
    error = _error(phase.result)
    for words in ("no space left on the file system of", f"{run_id}/checkpoints/step-00000008",
                  "(checkpoint step 8)", "it needs ", " free there", "df -h",
                  f"`lodger resume {run_id}` (checkpoint step-00000004 is intact"):
        assert words in error, f"{words!r} not in the error:\n{describe(phase.result)}"
    assert phase.checkpoints == ["step-00000004"] and phase.extra["verifies"] == ["step-00000004"]
    assert phase.stale == [], f"a half-written checkpoint is left taking space: {phase.stale}"
    assert phase.audit.returncode == 0 and "ledger intact" in phase.audit.stdout, describe(phase.audit)


def test_full_disk_during_a_ledger_write_rolls_it_back_whole_and_names_the_ledger(story):
    """error names ledger.db and the room it needs; audit clean; the checkpoint on disk waits for resume"""
    phase, home, run_id = story["phases"]["ledger"], story["home"], story["run_id"]
    assert phase.result.proc.returncode == 1, describe(phase.result)
    assert no_traceback(phase.result), describe(phase.result)
    error = _error(phase.result)
    for words in (f"no space left on the file system of {home / 'ledger.db'} (the ledger", "it needs 1.0 MiB",
                  f"`lodger resume {run_id}`"):
        assert words in error, f"{words!r} not in the error:\n{describe(phase.result)}"
    assert "step-00000008" in phase.checkpoints and phase.stale == []
    assert 8 not in phase.extra["recorded_steps"], "the ledger recorded a write the disk had no room for"
    assert phase.audit.returncode == 0 and "ledger intact" in phase.audit.stdout, describe(phase.audit)


def test_resume_once_space_is_freed_finishes_bitwise_equal_with_the_ledger_complete(story):
    """resume exits 0; every step's record, every eval loss and the adapter's bytes equal the
    uninterrupted run's; ledger records step 8; audit clean"""
    phase, baseline = story["phases"]["resume"], story["baseline"]
    assert phase.result.returncode == 0, describe(phase.result)
    assert "ledger completed from the run folder" in phase.result.stdout, describe(phase.result)
    assert phase.extra["records"] == baseline.records
    assert phase.extra["evals"] == baseline.evals and baseline.evals, (phase.extra["evals"], baseline.evals)
    assert phase.extra["adapter"] == baseline.adapter, "the final adapter differs from the uninterrupted run's"
    assert 8 in phase.extra["recorded_steps"] and phase.extra["recorded_steps"][-1] == 24
    assert phase.audit.returncode == 0, describe(phase.audit)


def test_full_disk_during_an_export_leaves_nothing_and_the_export_works_once_freed(story):
    """error names the folder and the space needed; no partial export; the same export then succeeds"""
    phase, disk, run_id = story["phases"]["export"], story["disk"], story["run_id"]
    assert phase.result.returncode == 1 and no_traceback(phase.result), describe(phase.result)
    error = _error(phase.result)
    for words in (f"no space left on the file system of {disk / 'export'} (the export)", "it needs about",
                  f"`lodger export {run_id} {disk / 'export'}` again"):
        assert words in error, f"{words!r} not in the error:\n{describe(phase.result)}"
    assert phase.stale == [], f"the failed export left {phase.stale}"
    again = phase.extra["again"]
    assert again.returncode == 0, describe(again)
    assert "MANIFEST.json" in phase.extra["exported"] or "manifest.json" in [n.lower() for n in phase.extra["exported"]]
    assert phase.audit.returncode == 0, describe(phase.audit)
