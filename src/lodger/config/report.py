"""[report]: the trackers a run's numbers go to while it trains (reporting/trackers.py, reporting/feed.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from .base import Section


class ReportConfig(Section):
    to: list[Literal["tensorboard", "mlflow", "trackio"]] = Field(default_factory=list)
    """Trackers the run's steps, evals, hyper-parameters and provenance go to, from what the ledger
    committed, after every checkpoint and once more when the run stops (any subset, e.g.
    ["tensorboard", "trackio"]). A tracker that fails is a warning and a `tracker_failed` event,
    never a stopped run. `lodger report RUN --to ...` sends a run afterwards."""
    dir: Path | None = None
    """Where TensorBoard's event files and Trackio's store go (default $LODGER_HOME/trackers)."""
    mlflow_uri: str | None = None
    """MLflow tracking URI (default $MLFLOW_TRACKING_URI, else a SQLite store under $LODGER_HOME/trackers)."""
