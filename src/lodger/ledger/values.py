"""Records as typed values: each built once, by the part that knows it, and handed as it is to the
ledger (and the reporter). Frozen: a record is what happened, not a form filled in bit by bit."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class NewRun:
    """A run as it is created: its identity, its job, and what the pre-flight estimated."""

    run_id: str
    name: str | None
    model: str
    method: str
    job_hash: str
    job_toml: str
    total_steps: int
    pid: int | None = None
    reproduces: str | None = None   # the run this one re-runs (`lodger reproduce`)
    managed: bool = False           # started by the agent, which restarts it
    estimate: dict | None = field(default=None, compare=False)  # the memory pre-flight's summary
