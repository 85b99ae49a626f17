"""When the agent starts a managed run again, and when it stops trying.

A managed run whose process is gone (a reboot, a kill, an exception) is started again at once the
first time. If that try dies too before committing a checkpoint, the next waits ``first_delay``
seconds, the one after twice as long, and so on; after ``max_tries`` failed tries in a row the agent
gives up: the run's status becomes ``gave_up`` (an event says why) until the owner resumes it.

The count lives in the ledger, not in the agent's memory, so an agent that restarts itself does not
start counting again: it is the number of ``agent_resume`` events since the run last made progress
(a committed checkpoint, a finish, a pause, or a give-up, which only the owner's resume undoes). A
``restart_delayed`` event records each wait, with when the next try is due.

A run on its way to training (created, or a worker still loading the model) holds a shared lock on
``starting`` in its folder; the agent never starts a second process beside it.
"""

from __future__ import annotations

import fcntl
import time
from dataclasses import dataclass
from pathlib import Path

from .. import durable
from .runlock import flock_held

RESTARTABLE = ("created", "running", "held", "interrupted", "failed")
"""Statuses of a managed run with no live process that the agent starts again."""
PROGRESS = ("checkpoint", "finished", "paused", "gave_up")
"""Events after which earlier failed tries no longer count."""
TRIES = ("agent_resume", "restart_delayed")

_held: list = []  # open files whose shared locks this process keeps until it exits


def mark_starting(folder: Path) -> None:
    """Say, until this process exits, that it is bringing the run in ``folder`` up."""
    fh = durable.open_file(Path(folder) / "starting", "a+")
    fcntl.flock(fh, fcntl.LOCK_SH)
    _held.append(fh)


def being_started(folder: Path) -> bool:
    """Whether some live process holds the run's ``starting`` lock."""
    return flock_held(Path(folder) / "starting")


@dataclass(frozen=True)
class Backoff:
    """How long to wait before each try after a failed one, and how many failed tries to allow."""

    first_delay: float = 10.0
    max_tries: int = 5

    def delay(self, failed: int) -> float:
        return self.first_delay * 2 ** (failed - 1)


@dataclass(frozen=True)
class Decision:
    """What the agent does with a managed run that has no live process."""

    action: str           # "restart", "wait", "delay" (record a wait, then wait) or "give_up"
    failed: int = 0       # failed tries in a row so far
    delay: float = 0.0    # for "delay": seconds until the next try


def decide(events: list[dict], backoff: Backoff, now: float | None = None) -> Decision:
    """The next step for a dead managed run, from its events (oldest first)."""
    now = time.time() if now is None else now
    recent: list[dict] = []
    for event in events:
        if event["kind"] in PROGRESS:
            recent = []
        elif event["kind"] in TRIES:
            recent.append(event)
    failed = sum(1 for e in recent if e["kind"] == "agent_resume")
    if not recent:
        return Decision("restart")
    last = recent[-1]
    if last["kind"] == "agent_resume":  # that try died before it committed anything
        if failed >= backoff.max_tries:
            return Decision("give_up", failed)
        return Decision("delay", failed, backoff.delay(failed))
    due = last["time"] + float(last["data"].get("delay_seconds", 0.0))
    return Decision("restart" if now >= due else "wait", failed)
