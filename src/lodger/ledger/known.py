"""The runs a ledger must know: every run folder in its home that a process has worked in.

SQLite takes a `ledger.db` of zero bytes (a failing disk, a truncation, someone covering their
tracks) or a missing one for a new, empty database, and a ledger put back from an old copy for a
whole one: `lodger ls` would say "no runs", `lodger audit` "intact", and new runs would start a
new chain beside folders full of checkpoints. The run folders say otherwise. A run's folder is
made with its job file (and the `starting` marker of its creator) just before the run's row is
committed, and nothing else is written into it until that commit has returned (synchronous=FULL:
it lasts a power cut). So a folder that holds anything more proves the ledger once recorded its
run; one holding no more is a run being created, or one whose creation died before the ledger
heard of it, and proves nothing.

Opening the ledger compares the two (one directory listing and one query: it costs well under a
millisecond with hundreds of runs) and refuses, naming the runs, before SQLite writes anything
into the file.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from ..errors import LedgerError
from .connection import connect

BEFORE_THE_ROW = frozenset({"job.toml", "starting"})
"""What a run folder holds before its run's row is committed (run.create_run, remote submit)."""

SHOWN = 10


def worked_in(runs: Path) -> set[str]:
    """Run ids whose folders under ``runs`` hold more than what precedes the run's row."""
    found: set[str] = set()
    try:
        entries = list(os.scandir(runs))
    except FileNotFoundError:
        return found
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=True):
            continue  # a folder being written (durable's temporaries) is hidden until renamed
        try:
            names = set(os.listdir(entry.path))
        except OSError:
            continue
        if names - BEFORE_THE_ROW:
            found.add(entry.name)
    return found


def folder_names(runs: Path) -> set[str]:
    try:
        return {e.name for e in os.scandir(runs) if not e.name.startswith(".")}
    except FileNotFoundError:
        return set()


def known_ids(db: sqlite3.Connection | None) -> set[str]:
    """The run ids of an open ledger (none in a database that has no runs table yet)."""
    if db is None:
        return set()
    try:
        return {row[0] for row in db.execute("SELECT id FROM runs")}
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return set()
        raise


def connect_known(path: Path) -> sqlite3.Connection:
    """``connection.connect(path)``, once the ledger there knows every run its home's folders prove
    it recorded: a missing or empty file is judged before SQLite makes it a new database."""
    if _empty(path):
        check_runs_known(path, None)
    db = connect(path)
    try:
        check_runs_known(path, db)
    except BaseException:
        db.close()
        raise
    return db


def check_known(path: Path) -> None:
    """The check ``connect_known`` makes, writing nothing and making no ledger where there is none:
    for a command that must refuse a ledger that lost runs before it prepares anything."""
    if _empty(path):
        check_runs_known(path, None)
        return
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
        try:
            check_runs_known(path, db)
        finally:
            db.close()
    except sqlite3.Error:
        return  # a file SQLite cannot read as it is: the command's own opening (Ledger) names it


def _empty(path: Path) -> bool:
    try:
        return path.stat().st_size == 0
    except FileNotFoundError:
        return True


def check_runs_known(path: Path, db: sqlite3.Connection | None) -> None:
    """Raise LedgerError naming the run folders in ``path``'s home that the ledger at ``path`` does
    not know (``db``: its open connection, None when the file is missing or empty)."""
    runs = path.parent / "runs"
    unknown = folder_names(runs) - known_ids(db)
    if not unknown:  # the common case: one listing, one query, nothing opened
        return
    lost = sorted(worked_in(runs) & unknown)
    if lost:
        raise LedgerError(lost_message(path, runs, lost))


def lost_message(path: Path, runs: Path, lost: list[str]) -> str:
    try:
        size = path.stat().st_size
        what = f"is {size:,} bytes" + (" (emptied: truncated, or a failing disk)" if size == 0 else "")
    except FileNotFoundError:
        what = "is missing"
    shown = ", ".join(lost[:SHOWN]) + (f" and {len(lost) - SHOWN} more" if len(lost) > SHOWN else "")
    return (f"{path}: the ledger does not know {len(lost)} run(s) whose folders in {runs} show they were "
            f"recorded: {shown}. The file {what}: it is not the ledger those runs were recorded in, and lodger "
            "will not take it for one. Put back ledger.db from a backup (`lodger audit --against WITNESS` then "
            f"says whether it is the chain you witnessed), or move those folders out of {runs} to start a new "
            "ledger without them.")


__all__ = ["BEFORE_THE_ROW", "check_known", "check_runs_known", "connect_known", "worked_in"]
