"""A ledger that lost runs its home's folders prove it recorded (ledger/known.py): a `ledger.db` of
zero bytes, a missing one, one put back from before a run. Opening it is an error naming the runs,
and nothing is written into the file; a folder holding only what precedes a run's row (its job
file, its creator's `starting` marker) is a run being created, not a lost one.

Every test uses a real SQLite file under the test's own LODGER_HOME (the autouse fixture).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from lodger.errors import LedgerError
from lodger.home import ledger_path, run_dir
from lodger.ledger import Ledger
from lodger.ledger.values import NewRun


def _run(ledger: Ledger, run_id: str, *files: str) -> Path:
    """A run as create_run leaves it (its folder with job.toml, then its row), then ``files`` in
    its folder as training writes them."""
    folder = run_dir(run_id)
    folder.mkdir(parents=True)
    (folder / "job.toml").write_text("x = 1\n")
    ledger.create_run(NewRun(run_id, name=run_id, model="m", method="lora", job_hash="h" * 64, job_toml="x = 1\n",
                             total_steps=4, pid=None))
    for name in files:
        (folder / name).write_text("")
    return folder


def test_a_zero_byte_ledger_beside_run_folders_is_refused_naming_them_and_stays_zero_bytes():
    with Ledger() as ledger:
        _run(ledger, "run-a", "metrics.jsonl", "log.txt")
        _run(ledger, "run-b", "lock")
    path = ledger_path()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    path.write_bytes(b"")
    with pytest.raises(LedgerError) as caught:
        Ledger()
    message = str(caught.value)
    assert message.startswith(f"{path}: the ledger does not know 2 run(s) whose folders in {path.parent / 'runs'}")
    assert "run-a, run-b" in message and "is 0 bytes (emptied" in message and "Put back ledger.db" in message
    assert path.stat().st_size == 0, "SQLite wrote into the emptied ledger"


def test_a_missing_ledger_beside_run_folders_is_refused_and_not_created():
    with Ledger() as ledger:
        _run(ledger, "run-a", "checkpoints")
    for suffix in ("", "-wal", "-shm"):
        Path(f"{ledger_path()}{suffix}").unlink(missing_ok=True)
    with pytest.raises(LedgerError, match=r"does not know 1 run\(s\) .*: run-a\. The file is missing"):
        Ledger()
    assert not ledger_path().exists()


def test_a_ledger_put_back_from_before_a_run_names_only_the_run_it_lost(tmp_path):
    with Ledger() as ledger:
        _run(ledger, "run-old", "metrics.jsonl")
    backup = tmp_path / "ledger.db"
    with Ledger() as ledger:
        ledger.db.execute(f"VACUUM INTO '{backup}'")  # a whole copy, as a backup tool takes it
        _run(ledger, "run-new", "metrics.jsonl")
    for suffix in ("-wal", "-shm"):
        Path(f"{ledger_path()}{suffix}").unlink(missing_ok=True)
    shutil.copyfile(backup, ledger_path())
    with pytest.raises(LedgerError, match=r"does not know 1 run\(s\) .*: run-new\. The file is [\d,]+ bytes:"):
        Ledger()


def test_a_run_folder_holding_only_its_job_file_is_a_run_being_created_not_a_lost_one():
    """job.toml and `starting` come before the run's row: such a folder proves nothing; a lock does"""
    folder = run_dir("being-created")
    folder.mkdir(parents=True)
    (folder / "job.toml").write_text("x = 1\n")
    (folder / "starting").write_text("")
    (folder.parent / ".tmp-half-written").mkdir()  # durable.write_folder's temporary, not yet a run
    Ledger().close()
    (folder / "lock").write_text("")
    with pytest.raises(LedgerError, match="being-created"):
        Ledger()


def test_the_check_costs_under_two_milliseconds_with_three_hundred_runs():
    """one listing and one query when the ledger knows every folder (what every command pays)"""
    with Ledger() as ledger:
        with ledger.transaction():
            for n in range(300):
                _run(ledger, f"run-{n:03d}", "metrics.jsonl")
    from lodger.ledger.known import check_runs_known

    with Ledger() as ledger:
        started = time.perf_counter()
        for _ in range(20):
            check_runs_known(ledger.path, ledger.db)
        each = (time.perf_counter() - started) / 20
    print(f"\nthe check with 300 runs: {each * 1000:.3f} ms")
    assert each < 0.002, f"{each * 1000:.2f} ms"


def test_the_check_before_a_run_is_prepared_makes_no_ledger_and_refuses_one_that_lost_runs():
    """check_known (create_run's first step): no ledger.db appears in a new home; a known run passes;
    the same home with ledger.db emptied is refused"""
    from lodger.ledger.known import check_known

    check_known(ledger_path())
    assert not ledger_path().exists(), "a refused job would leave a new ledger behind"
    with Ledger() as ledger:
        _run(ledger, "run-a", "lock")
    check_known(ledger_path())
    for suffix in ("-wal", "-shm"):
        Path(f"{ledger_path()}{suffix}").unlink(missing_ok=True)
    ledger_path().write_bytes(b"")
    with pytest.raises(LedgerError, match="run-a"):
        check_known(ledger_path())
