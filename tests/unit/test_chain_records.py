"""Every table against the chain (ledger/records.py), and the queue's starting -> started / requeued
transitions, on real SQLite files; tampering goes through a raw sqlite3 connection."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest

import lodger.ledger as ledger_module
from lodger.owner.agent import Agent, StarterLock
from lodger.home import ledger_path
from lodger.ledger import Ledger
from lodger.ledger.migrations import MIGRATIONS
from lodger.ledger.values import NewRun


def raw() -> sqlite3.Connection:
    db = sqlite3.connect(ledger_path(), isolation_level=None)
    db.row_factory = sqlite3.Row
    return db


def problems() -> list[str]:
    with Ledger() as ledger:
        return [f"{p.where()}: {p.problem}" for p in ledger.audit_records()]


def a_run(ledger: Ledger, run_id: str = "run-a") -> None:
    ledger.create_run(NewRun(run_id, name="a", model="m", method="lora", job_hash="h" * 64, job_toml="x = 1\n",
                      total_steps=10, pid=None))


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# -- runs, metrics, provenance ---------------------------------------------------------------
def test_rows_written_through_the_ledger_agree_with_the_chain_through_truncation_and_rewrite():
    with Ledger() as ledger:
        a_run(ledger)
        ledger.set_status("run-a", "running", "started", step=0, segment=0)
        ledger.add_provenance("run-a", 0, {"data": {"sha256": "a" * 64}})
        ledger.add_metrics("run-a", 0, [{"kind": "train", "step": s, "loss": 1.0 / s} for s in (1, 2, 3, 4)])
        ledger.event("run-a", "checkpoint", step=4, loss=0.25)
        assert ledger.truncate_metrics("run-a", 2) == 2  # a resume from step 2 redoes 3 and 4
        ledger.add_metrics("run-a", 1, [{"kind": "train", "step": s, "loss": 2.0 / s} for s in (3, 4)])
        ledger.update_run("run-a", managed=1, pid=123)
        ledger.set_status("run-a", "finished")
        run = ledger.run("run-a")
    assert (run["status"], run["step"], run["loss"], run["managed"]) == ("finished", 4, 0.25, 1)
    assert problems() == []


def test_a_truncation_that_drops_the_eval_at_its_own_step_agrees_with_the_chain():
    """A resume from a checkpoint with no result for its step's eval (a release abandoned it)
    drops that eval's row too (it runs again); the audit's replay drops the same row."""
    with Ledger() as ledger:
        a_run(ledger)
        ledger.add_metrics("run-a", 0, [{"kind": "train", "step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
                           + [{"kind": "eval", "step": 2, "eval_loss": 0.5}])
        assert ledger.truncate_metrics("run-a", 2, eval_kept=False) == 2  # train 3 and the eval at 2
        assert [m["step"] for m in ledger.metrics("run-a", "eval")] == []
        assert [m["step"] for m in ledger.metrics("run-a")] == [1, 2]
    assert problems() == []


def test_a_deleted_metric_row_an_inserted_one_and_an_inserted_run_are_named():
    with Ledger() as ledger:
        a_run(ledger)
        ledger.add_metrics("run-a", 0, [{"kind": "train", "step": s, "loss": 1.0} for s in (1, 2)])
    with raw() as db:
        db.execute("DELETE FROM metrics WHERE step=2")
        db.execute("""INSERT INTO metrics VALUES ('run-a', 'eval', 7, 0, '{"eval_loss":0.1}')""")
        db.execute("INSERT INTO runs (id, name, created, updated, status) VALUES ('ghost', 'g', 1, 1, 'finished')")
        db.execute("UPDATE runs SET job_toml='x = 2\n' WHERE id='run-a'")
    found = problems()
    assert "table metrics, run run-a, step 2: the train row recorded by the chain is gone (deleted)" in found
    assert any(p.startswith("table metrics, run run-a, step 7: the eval row is not covered") for p in found)
    assert any(p.startswith("table runs, run ghost: has no `created` event") for p in found)
    assert any(p.startswith("table runs, run run-a: column job_toml does not match") for p in found)
    assert len(found) == 4, found


def test_a_dataset_event_edited_without_its_hash_is_refused_by_the_registry(tmp_path):
    from lodger.data import registry as datasets
    from lodger.errors import DatasetError

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    datasets.add(data, name="d", license="MIT", owner="me")
    with raw() as db:  # the event and the row agree, but the event no longer matches its own hash
        row = db.execute("SELECT seq, data FROM events WHERE kind='dataset_added'").fetchone()
        db.execute("UPDATE events SET data=? WHERE seq=?", (row["data"].replace('"may_leave":false',
                                                                                '"may_leave":true'), row["seq"]))
        db.execute("UPDATE datasets SET may_leave=1")
    with pytest.raises(DatasetError, match=r"dataset 'd': its `dataset_added` event \(row 1\) does not match"):
        datasets.list_datasets()


# -- an older ledger -------------------------------------------------------------------------
def test_a_ledger_from_before_0005_audits_clean_and_its_queue_entries_must_be_queued_again(monkeypatch):
    with monkeypatch.context() as m:  # rows as the previous version wrote them, with its events
        m.setattr(ledger_module, "MIGRATIONS", MIGRATIONS[:4])
        with Ledger() as old:
            old.db.execute("INSERT INTO runs (id, name, created, updated, status, step, loss, total_steps, job_toml)"
                           " VALUES ('old', 'o', 1, 1, 'finished', 4, 0.5, 4, 'x = 1')")
            old.event("old", "created", job_hash="h", model="m", method="lora", total_steps=4)
            old.db.execute("INSERT INTO metrics VALUES ('old', 'train', 4, 0, '{\"loss\":0.5}')")
            old.db.execute("INSERT INTO provenance VALUES ('old', 0, 1, '{}')")
            old.db.execute("INSERT INTO queue (name, job_path, job_toml, priority, added, state) "
                           "VALUES ('q', 'q.toml', 'x = 1', 0, 1, 'queued')")
            old.event(None, "queued", queue_id=1, name="q", priority=0, job_path="q.toml")
    with Ledger() as ledger:
        count, chain = ledger.audit()
        assert (count, chain) == (2, [])
        assert ledger.audit_records() == []
        assert "queued before lodger recorded the sha256" in ledger.queue_text_problem(1)


# -- the queue -------------------------------------------------------------------------------
def queued(ledger: Ledger) -> int:
    return ledger.enqueue("q", "/nowhere/q.toml", "x = 1\n", 0)


def queue_events(ledger: Ledger, kind: str) -> list[dict]:
    return [e["data"] for e in ledger.events() if e["kind"] == kind]


def test_a_starting_entry_whose_agent_is_gone_and_whose_run_never_appeared_is_requeued():
    with Ledger() as ledger:
        qid = queued(ledger)
        gone = dead_pid()
        assert ledger.take_from_queue(qid, "q-run-1", agent_pid=gone)
        assert ledger.queue_entry(qid)["state"] == "starting"
        Agent(ledger)._settle_starting()
        entry = ledger.queue_entry(qid)
        [requeued] = queue_events(ledger, "queue_requeued")
    assert (entry["state"], entry["run_id"]) == ("queued", None)
    assert requeued["lost_run_id"] == "q-run-1" and f"pid {gone}" in requeued["reason"]
    assert problems() == []


def test_a_starting_entry_whose_run_exists_is_started_and_one_being_started_is_left_alone():
    with Ledger() as ledger:
        first, second = queued(ledger), queued(ledger)
        ledger.take_from_queue(first, "run-a", agent_pid=dead_pid())
        a_run(ledger, "run-a")  # the starter created the run, then died before marking it started
        ledger.take_from_queue(second, "q-run-2", agent_pid=dead_pid())
        lock = StarterLock(second)  # a starter is creating the second one's run right now
        try:
            Agent(ledger)._settle_starting()
        finally:
            lock.release()
        assert (ledger.queue_entry(first)["state"], ledger.queue_entry(first)["run_id"]) == ("started", "run-a")
        assert ledger.queue_entry(second)["state"] == "starting"
        assert queue_events(ledger, "queue_requeued") == []
    assert problems() == []


def test_a_start_taken_by_this_agent_is_requeued_once_its_starter_has_exited_or_the_grace_is_over():
    with Ledger() as ledger:
        mine, stuck = queued(ledger), queued(ledger)
        agent = Agent(ledger)
        ledger.take_from_queue(mine, "q-run-1", agent_pid=os.getpid())
        starter = subprocess.Popen([sys.executable, "-c", "pass"])
        starter.wait()
        agent.queue_children[mine] = starter
        ledger.take_from_queue(stuck, "q-run-2", agent_pid=1)  # alive, not ours: only the grace period tells
        agent.starting_grace = 0.0
        agent._settle_starting()
        reasons = {e["queue_id"]: e["reason"] for e in queue_events(ledger, "queue_requeued")}
    assert "starter process ended" in reasons[mine]
    assert "no run q-run-2 after" in reasons[stuck]


def test_the_starter_refuses_a_job_whose_text_was_edited(tmp_path):
    with Ledger() as ledger:
        qid = queued(ledger)
        ledger.take_from_queue(qid, "q-run-1", agent_pid=1)
    with raw() as db:
        db.execute("UPDATE queue SET job_toml='x = 2\n'")
    result = subprocess.run([sys.executable, "-m", "lodger.cli.main", "_start-queued", str(qid)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert f"queued job #{qid} refused: its job text" in result.stderr and "Traceback" not in result.stderr
    with Ledger() as ledger:
        assert ledger.queue_entry(qid)["state"] == "refused"
        assert len(queue_events(ledger, "queue_refused")) == 1
        assert ledger.runs() == []
    assert [p for p in problems() if "queue" in p] == ["table queue, queue entry #1: column job_toml does not match "
                                                        "the sha256 in its `queued` event (the job text was edited)"]


def test_a_starter_that_outlived_a_requeue_does_not_start_the_job_again():
    with Ledger() as ledger:
        qid = queued(ledger)
        ledger.take_from_queue(qid, "q-run-new", agent_pid=1)  # taken again after the old start was requeued
    result = subprocess.run([sys.executable, "-m", "lodger.cli.main", "_start-queued", str(qid), "q-run-old"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "not being started as run q-run-old" in result.stderr, result.stderr
    with Ledger() as ledger:
        assert ledger.queue_entry(qid)["state"] == "starting" and ledger.runs() == []


def test_a_non_finite_loss_in_a_checkpoint_event_agrees_with_the_null_sqlite_stores():
    with Ledger() as ledger:
        a_run(ledger)
        ledger.event("run-a", "checkpoint", step=2, loss=float("nan"))
        assert ledger.run("run-a")["loss"] is None
    assert problems() == []
