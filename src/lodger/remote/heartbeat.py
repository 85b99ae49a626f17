"""Wall time that counts what was spent: one heartbeat object per submission in the run's storage.

The worker rewrites ``heartbeats/<submission_id>.json`` every few seconds with the wall time that
submission has run so far (and once more when its training process ends). A segment killed
without a word (SIGKILL, a lost node) keeps its last heartbeat, so the next submission starts
with every earlier submission's wall time counted (``PRIOR_ENV``, read by train/limits.py), and
`lodger resume` refuses to submit a job that already spent its ``[remote] wall_hours``.
At most one interval of a killed segment goes uncounted.
"""

from __future__ import annotations

import json
import math
import os
import time

from ..train.limits import PRIOR_WALL_ENV
from .backend import RemoteError

PREFIX = "heartbeats"
PRIOR_ENV = PRIOR_WALL_ENV  # earlier submissions' wall seconds, for the training process
INTERVAL_ENV = "LODGER_HEARTBEAT_SECONDS"  # how often the worker writes its heartbeat (default below)
DEFAULT_INTERVAL = 10.0  # one small PUT every 10 s: negligible cost, at most 10 s of a killed segment lost


def interval() -> float:
    try:
        value = float(os.environ.get(INTERVAL_ENV) or DEFAULT_INTERVAL)
    except ValueError:
        return DEFAULT_INTERVAL
    return value if math.isfinite(value) and value > 0 else DEFAULT_INTERVAL


def write(store, submission_id: str, wall_seconds: float, segment: int | None = None, ended: bool = False) -> None:
    """Replace this submission's heartbeat (one atomic PUT)."""
    body = {"submission_id": submission_id, "wall_seconds": round(float(wall_seconds), 3), "time": time.time(),
            "segment": segment, "ended": ended}
    store.write_bytes(f"{PREFIX}/{submission_id}.json", json.dumps(body, sort_keys=True).encode())


def read_all(store) -> dict[str, float]:
    """submission id -> wall seconds, for every heartbeat that parses (others are left out)."""
    out = {}
    for name in store.list(PREFIX):
        if not name.endswith(".json"):
            continue
        try:
            value = float(json.loads(store.read_bytes(f"{PREFIX}/{name}"))["wall_seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if math.isfinite(value) and value >= 0:
            out[name.removesuffix(".json")] = value
    return out


def spent_wall_seconds(store, exclude: str | None = None) -> float:
    """Wall seconds every submission of the run spent (but ``exclude``, the one starting now)."""
    return sum(v for k, v in read_all(store).items() if k != exclude)


def refuse_past_wall_limit(store, run_id: str, wall_hours: float | None) -> None:
    """RemoteError when the run's submissions already spent its ``[remote] wall_hours``."""
    if wall_hours is None:
        return
    spent = spent_wall_seconds(store)
    if spent / 3600 >= wall_hours:
        raise RemoteError(f"run {run_id} already spent {spent / 3600:.4f} h of its [remote] wall_hours = "
                          f"{wall_hours:g} (heartbeats in {store.uri}/{PREFIX}, killed segments included); "
                          "it is not resubmitted: raise [remote] wall_hours in the job and submit it again")
