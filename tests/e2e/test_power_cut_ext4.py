"""Power cuts on a real file system, beside the model of one (test_power_cut.py).

$LODGER_HOME on ext4 on a loop device (tests/real_fs.py); the standard job is stopped (SIGSTOP) at
a named fault point, the file system shut down without flushing its journal (EXT4_IOC_SHUTDOWN,
NOLOGFLUSH: what no fsync had committed is dropped), the process killed, the file system unmounted
and mounted again. Then the same checks as the model's states (power_cut_checks.state_problems):
the ledger audits clean and holds every row it had committed when the power went (read from a copy
taken while the process stood still), every checkpoint there verifies and the newest the ledger
recorded is among them, metrics.jsonl holds every line up to it, the job file is there; and
`lodger resume` ends bitwise equal to the uninterrupted run, `lodger audit` intact.

`make test` runs one trial (the rename of checkpoint 8 done, its folder not yet fsynced); bench/
faults.py (LODGER_FAULTS_ALL=1) runs every checkpoint fault point and the ledger's.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from faults_helpers import ALL_ENV, wait_stopped
from helpers import lodger_env, start_lodger
from power_cut import read_tree
from power_cut_checks import assert_resumes_to_the_end, exact, metric_records, paths, reported_by, state_problems
from real_fs import ext4_disk

pytestmark = pytest.mark.faults

TRIALS = ["before_dir_fsync@2"]
if os.environ.get(ALL_ENV):
    TRIALS += ["after_create_run", "after_tensors@2", "before_manifest@2", "before_rename@2", "during_prune@1",
               "checkpoint_before_ledger@2", "checkpoint_after_ledger@2"]


@pytest.mark.parametrize("fault", TRIALS)
def test_ext4_shut_down_at_a_fault_point_keeps_what_lodger_reported_and_resumes_bitwise_equal(
        fault: str, standard_job: Path, baseline, tmp_path: Path) -> None:
    """after the journal-dropping shutdown: audit clean, reported rows and checkpoints there, resume exact"""
    with ext4_disk(tmp_path / "disk") as disk:
        home = disk.mount / "home"
        home.mkdir(mode=0o700)
        os.sync()  # the empty home is on disk before the trial: only lodger's own writes are at stake
        running = start_lodger(["run", standard_job, "--quiet"], lodger_env(home, LODGER_FAULT=f"{fault}:stop"),
                               tmp_path / "logs")
        try:
            wait_stopped(running.proc.pid)
            # (stopped before it printed its id, at after_create_run: the one run folder names it)
            run_id, = [p.name for p in (home / "runs").iterdir() if not p.name.startswith(".")]
            # Stopped at a fault point, outside any SQLite call: these files hold every commit it reported.
            (tmp_path / "reported").mkdir()
            for name in ("ledger.db", "ledger.db-wal"):
                if (home / name).exists():
                    shutil.copyfile(home / name, tmp_path / "reported" / name)
            live = paths(read_tree(home))
            disk.cut_power()
        finally:
            running.close()
        disk.remount()
        lost = sorted(path for path, _ in live - paths(read_tree(home)))
        print(f"ext4 cut at {fault}: {len(lost)} name(s) a kill would have kept are gone: {lost[:4]}")
        if fault == "before_dir_fsync@2":  # the rename into step 8 was never fsynced: a real cut undoes it
            assert f"runs/{run_id}/checkpoints/step-00000008" in lost, f"the shutdown kept everything: {lost}"
        reference = metric_records((baseline.run_dir / "metrics.jsonl").read_bytes())
        problems = state_problems(read_tree(home), reported_by(tmp_path / "reported" / "ledger.db", run_id), run_id,
                                  reference, None, tmp_path / "state", same=lambda a, b: exact(a) == exact(b))
        assert not problems, f"ext4 cut at {fault}:\n  " + "\n  ".join(problems)
        assert_resumes_to_the_end(home, run_id, baseline, f"ext4 cut at {fault}")
