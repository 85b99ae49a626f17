"""Where a run lives, chosen once from its ledger row (remote/executors.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lodger.errors import LodgerError, RunStateError
from lodger.remote.executors import Asked, LocalExecutor, RemoteExecutor, executor_for, wait_answered


def test_a_run_with_a_target_is_remote_and_any_other_is_local() -> None:
    assert isinstance(executor_for({"id": "r", "target": "lab-ray"}), RemoteExecutor)
    assert isinstance(executor_for({"id": "r", "target": None}), LocalExecutor)
    assert isinstance(executor_for({"id": "r"}), LocalExecutor)


def test_cancelling_a_local_run_is_refused_with_the_command_that_stops_it(lodger_home: Path) -> None:
    with pytest.raises(RunStateError, match="lodger pause r1"):
        LocalExecutor().cancel(None, {"id": "r1", "status": "running"})  # type: ignore[arg-type]


def test_resuming_a_finished_local_run_nobody_holds_is_refused(lodger_home: Path) -> None:
    (lodger_home / "runs" / "r1").mkdir(parents=True)
    with pytest.raises(RunStateError, match="already finished"):
        LocalExecutor().resume(None, {"id": "r1", "status": "finished"})  # type: ignore[arg-type]


def test_a_stopped_local_run_that_no_process_trains_is_started_here_again(lodger_home: Path) -> None:
    (lodger_home / "runs" / "r1").mkdir(parents=True)
    assert LocalExecutor().resume(None, {"id": "r1", "status": "paused"}) is None  # type: ignore[arg-type]


def test_a_pause_that_is_never_answered_times_out_naming_the_run(tmp_path: Path) -> None:
    folder = tmp_path / "r1"
    folder.mkdir()
    asked = Asked({"id": "r1", "status": "running"}, folder, None, time.time())
    with pytest.raises(LodgerError, match="run r1 did not hold within 0 s"):
        wait_answered(asked, hold=True, since=time.monotonic(), timeout=0.05)
