"""Live status of remote runs: what `status`, `show` and `ls` ask the cluster (no ray, no torch).

For every remote run that has not ended (submitted, created, running, held) the run's backend is
asked how its current submission is, within one budget for the whole command (``BUDGET_S``), and
only then are the files synced from storage: a job the engine says ended has written all it will,
so a run still active after the sync died without a word and is recorded as ``crashed`` (a chained
``remote_job_ended`` event). A cluster that does not answer is named once, and its runs are shown
as last synced, marked as such, never as current.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .backend import TERMINAL, ClusterUnreachable, RemoteError

ACTIVE = ("submitted", "created", "running", "held")  # what only the engine can tell ended
BUDGET_S = 2.0  # for every question to every cluster of one command together


@dataclass
class Live:
    """The runs as refreshed, what each engine said, and what could not be asked."""

    runs: list[dict]
    engine: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)  # run id -> (status, message)
    stale: dict[str, str] = field(default_factory=dict)       # run id -> address that did not answer
    warnings: list[str] = field(default_factory=list)


def settle(ledger, run: dict, status: str | None, message: str | None) -> dict:
    """Record a run the engine says ended while it still says it is going as crashed; return the row."""
    if status in TERMINAL and run["status"] in ACTIVE:
        ledger.set_status(run["id"], "crashed", "remote_job_ended", ray_status=status, message=message,
                          step=run["step"], submission_id=run["remote_job_id"])
        return ledger.run(run["id"])
    return run


def refresh(ledger, runs: list[dict], budget: float = BUDGET_S) -> Live:
    """Sync every remote run among ``runs`` from storage and ask its cluster about the active ones.

    Local runs pass through untouched; nothing is asked when no remote run is active."""
    from . import backend_for
    from .place import remote_info
    from .sync import sync

    live = Live(runs=[])
    deadline = time.monotonic() + budget
    down: set[str] = set()
    for run in runs:
        if not run.get("target"):
            live.runs.append(run)
            continue
        address = remote_info(run).get("address", "?")
        answer = None
        if run["status"] in ACTIVE and address not in down and time.monotonic() >= deadline:
            down.add(address)
            live.warnings.append(f"cluster at {address} not asked: the {budget:g} s for asking were spent; "
                                 "showing the last synced state")
        if run["status"] in ACTIVE and address not in down:
            try:
                answer = backend_for(run).status(run, timeout=deadline - time.monotonic())
                live.engine[run["id"]] = answer
            except ClusterUnreachable as exc:
                down.add(address)
                live.warnings.append(f"cluster at {address} unreachable ({budget:g} s); showing the last synced "
                                     f"state ({exc.why})")
            except RemoteError as exc:
                live.warnings.append(f"{run['id']}: {exc}")
        try:
            run = sync(ledger, run)
        except RemoteError as exc:  # storage refused (changed job, unreadable): shown as last recorded
            live.warnings.append(f"{run['id']}: {exc}")
            answer = None  # what the run wrote at its end was not read: nothing to conclude from Ray
        if answer is not None:
            run = settle(ledger, run, *answer)
        if run["status"] in ACTIVE and address in down:
            live.stale[run["id"]] = address
        live.runs.append(run)
    return live
