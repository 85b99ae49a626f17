"""Where things live under $LODGER_HOME (default ~/.lodger). Nothing here imports torch."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """The root of all lodger state; created on first use."""
    root = Path(os.environ.get("LODGER_HOME") or Path.home() / ".lodger").expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def runs_dir() -> Path:
    path = home() / "runs"
    path.mkdir(exist_ok=True)
    return path


def run_dir(run_id: str) -> Path:
    return runs_dir() / run_id


def ledger_path() -> Path:
    return home() / "ledger.db"


def cache_dir(kind: str) -> Path:
    """A cache folder (``models``, ``tokens``, ``hashes``); safe to delete at any time."""
    path = home() / "cache" / kind
    path.mkdir(parents=True, exist_ok=True)
    return path
