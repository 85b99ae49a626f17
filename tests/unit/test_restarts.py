"""The agent's restart decisions from a run's events: at once, after growing delays, then never."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lodger.owner.agent import Agent, agent_log_path
from lodger.ledger import Ledger
from lodger.owner.restarts import Backoff, being_started, decide, mark_starting

BACKOFF = Backoff(first_delay=2.0, max_tries=3)


def ev(kind: str, at: float, **data) -> dict:
    return {"kind": kind, "time": at, "data": data}


def test_a_run_that_died_after_progress_is_restarted_at_once() -> None:
    events = [ev("started", 0), ev("checkpoint", 1, step=4), ev("agent_resume", 2), ev("checkpoint", 3, step=8)]
    assert decide(events, BACKOFF, now=4).action == "restart"


def test_each_failed_try_doubles_the_wait_and_the_cap_gives_up() -> None:
    events = [ev("checkpoint", 0, step=4), ev("agent_resume", 1)]
    first = decide(events, BACKOFF, now=1.5)
    assert (first.action, first.failed, first.delay) == ("delay", 1, 2.0)
    events.append(ev("restart_delayed", 1.5, delay_seconds=first.delay))
    assert decide(events, BACKOFF, now=3.4).action == "wait"
    assert decide(events, BACKOFF, now=3.5).action == "restart"
    events.append(ev("agent_resume", 3.5))
    second = decide(events, BACKOFF, now=4)
    assert (second.action, second.failed, second.delay) == ("delay", 2, 4.0)
    events += [ev("restart_delayed", 4, delay_seconds=4.0), ev("agent_resume", 8)]
    assert decide(events, BACKOFF, now=9) == decide(events, BACKOFF, now=99)
    assert decide(events, BACKOFF, now=9).action == "give_up" and decide(events, BACKOFF, now=9).failed == 3


def test_a_give_up_then_the_owners_resume_counts_from_zero() -> None:
    events = [ev("agent_resume", 1), ev("agent_resume", 2), ev("agent_resume", 3), ev("gave_up", 4),
              ev("resumed", 5)]
    assert decide(events, BACKOFF, now=6).action == "restart"


def test_the_starting_lock_is_seen_while_its_holder_lives_and_not_after(tmp_path: Path) -> None:
    assert not being_started(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from lodger.owner.restarts import mark_starting; "
                               f"mark_starting({str(tmp_path)!r}); print('held', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert being_started(tmp_path)
        mark_starting(tmp_path)  # shared: a creator and the worker it spawned hold it together
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)
    assert being_started(tmp_path)  # this process still holds it


def test_a_tick_that_raises_is_logged_with_its_traceback_and_the_next_tick_runs(lodger_home: Path) -> None:
    agent = Agent(Ledger(), interval=0.05)
    agent.ledger.db.close()  # every query of this tick now raises
    assert agent.safe_tick() is False
    text = agent_log_path().read_text()
    assert "error in tick: ProgrammingError" in text and "Traceback (most recent call last)" in text, text
    agent.ledger = Ledger()
    assert agent.safe_tick() is True
    events = agent.ledger.events()
    agent.ledger.close()
    assert [e["kind"] for e in events] == []  # its error event could not be written: the log has it


def test_the_same_error_at_every_tick_is_logged_once_and_a_new_one_again(lodger_home: Path) -> None:
    agent = Agent(Ledger(), interval=0.05)
    agent.ledger.db.close()
    for _ in range(5):
        assert agent.safe_tick() is False
    assert agent_log_path().read_text().count("Traceback") == 1
    assert agent.errors["tick"]["count"] == 5
    try:
        raise ValueError("another problem")
    except ValueError as exc:
        agent.log_error("tick", exc)
    assert agent_log_path().read_text().count("Traceback") == 2
