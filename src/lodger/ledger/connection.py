"""Opening the ledger's SQLite file: WAL, synchronous=FULL, and patience with other processes."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

OPEN_SECONDS = 30.0


def connect(path: Path) -> sqlite3.Connection:
    """A connection in WAL mode with synchronous=FULL. Switching to WAL takes a lock for which
    SQLite may answer "database is locked" at once, without its busy handler (seen with several
    lodger processes opening the ledger while others commit): tried again until OPEN_SECONDS."""
    deadline, pause = time.monotonic() + OPEN_SECONDS, 0.005
    while True:
        db = sqlite3.connect(path, timeout=OPEN_SECONDS, isolation_level=None)
        try:
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA busy_timeout=30000")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")  # a commit lasts once it returns: docs/power-cut.md, 7
            return db
        except sqlite3.OperationalError as exc:
            db.close()
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(pause)  # another process holds the lock for a moment: back off, then ask again
        pause = min(pause * 2, 0.2)
