"""The ledger: an append-only, hash-chained record of runs, events, metrics and provenance.

SQLite in WAL mode with synchronous=FULL. Every event row carries the hash of the previous row;
``audit()`` finds an edited, deleted or inserted row. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ..errors import LedgerError, RunNotFound
from ..home import ledger_path
from .migrations import MIGRATIONS

GENESIS = "0" * 64
EVENT_KINDS = ("created", "started", "checkpoint", "interrupted", "resumed", "drift", "damaged_checkpoint",
               "failed", "finished", "warning")


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def event_hash(prev_hash: str, seq: int, run_id: str | None, at: float, kind: str, data: str) -> str:
    body = _canonical([prev_hash, seq, run_id, repr(at), kind, data])
    return hashlib.sha256(body.encode()).hexdigest()


@dataclass
class AuditProblem:
    seq: int
    problem: str


class Ledger:
    """One connection to the ledger database; safe to use from several processes at once."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path or ledger_path())
        try:
            self.db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("PRAGMA busy_timeout=30000")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            raise LedgerError(f"{self.path}: cannot open the ledger: {exc}") from None

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _migrate(self) -> None:
        self.db.execute("CREATE TABLE IF NOT EXISTS migrations (name TEXT PRIMARY KEY, applied REAL NOT NULL)")
        applied = {r[0] for r in self.db.execute("SELECT name FROM migrations")}
        for name, sql in MIGRATIONS:
            if name in applied:
                continue
            self.db.execute("BEGIN IMMEDIATE")
            try:
                if self.db.execute("SELECT 1 FROM migrations WHERE name=?", (name,)).fetchone():
                    self.db.execute("ROLLBACK")  # another process applied it meanwhile
                    continue
                for statement in sql.split(";"):
                    if statement.strip():
                        self.db.execute(statement)
                self.db.execute("INSERT INTO migrations VALUES (?, ?)", (name, time.time()))
                self.db.execute("COMMIT")
            except Exception:
                self.db.execute("ROLLBACK")
                raise

    # -- events ------------------------------------------------------------------------------
    def _append_event(self, run_id: str | None, kind: str, data: dict) -> int:
        head = self.db.execute("SELECT seq, hash FROM chain_head WHERE id=1").fetchone()
        prev_seq, prev_hash = (head["seq"], head["hash"]) if head else (0, GENESIS)
        seq, at, text = prev_seq + 1, time.time(), _canonical(data)
        digest = event_hash(prev_hash, seq, run_id, at, kind, text)
        self.db.execute("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (seq, run_id, at, kind, text, prev_hash, digest))
        self.db.execute("INSERT INTO chain_head VALUES (1, ?, ?) ON CONFLICT(id) DO UPDATE SET seq=?, hash=?",
                        (seq, digest, seq, digest))
        return seq

    def event(self, run_id: str | None, kind: str, **data: Any) -> int:
        """Append one event to the chain (atomically, whoever else is writing)."""
        with self.transaction():
            return self._append_event(run_id, kind, data)

    def head(self) -> dict:
        """The chain's newest row as {"seq", "hash", "time"} ({"seq": 0, "hash": GENESIS} when empty).

        This is what exports and submissions carry, and what a witness file records."""
        row = self.db.execute("SELECT seq, hash, time FROM events ORDER BY seq DESC LIMIT 1").fetchone()
        if row is None:
            return {"seq": 0, "hash": GENESIS, "time": None}
        return {"seq": row["seq"], "hash": row["hash"], "time": row["time"]}

    def transaction(self):
        return _Transaction(self.db)

    def events(self, run_id: str | None = None) -> list[dict]:
        sql, args = "SELECT * FROM events", ()
        if run_id is not None:
            sql, args = sql + " WHERE run_id=?", (run_id,)
        rows = self.db.execute(sql + " ORDER BY seq", args).fetchall()
        return [{**dict(r), "data": json.loads(r["data"])} for r in rows]

    def audit(self) -> tuple[int, list[AuditProblem]]:
        """Walk the chain; return (rows checked, problems). No problems means the chain is intact."""
        problems: list[AuditProblem] = []
        prev_hash, expected = GENESIS, 1
        self.db.execute("BEGIN")  # one snapshot for rows and head, whoever is writing meanwhile
        try:
            rows = self.db.execute("SELECT * FROM events ORDER BY seq").fetchall()
            head = self.db.execute("SELECT seq, hash FROM chain_head WHERE id=1").fetchone()
        finally:
            self.db.execute("COMMIT")
        for row in rows:
            if row["seq"] != expected:
                problems.append(AuditProblem(expected, f"rows {expected}..{row['seq'] - 1} are missing (deleted)"))
            if row["prev_hash"] != prev_hash:
                problems.append(AuditProblem(row["seq"], "does not link to the row before it "
                                             "(a row before it was changed, deleted or inserted)"))
            digest = event_hash(row["prev_hash"], row["seq"], row["run_id"], row["time"], row["kind"], row["data"])
            if digest != row["hash"]:
                problems.append(AuditProblem(row["seq"], "its content does not match its hash (edited)"))
            prev_hash, expected = row["hash"], row["seq"] + 1
        last = rows[-1]["seq"] if rows else 0
        if head is not None and (head["seq"] != last or head["hash"] != prev_hash):
            problems.append(AuditProblem(head["seq"], f"the chain should end at row {head['seq']} but ends "
                                         f"at row {last} (rows at the end were deleted or replaced)"))
        return len(rows), problems

    # -- runs --------------------------------------------------------------------------------
    def create_run(self, run_id: str, *, name: str | None, model: str, method: str, job_hash: str,
                   job_toml: str, total_steps: int, pid: int | None, reproduces: str | None = None,
                   managed: bool = False, estimate: dict | None = None) -> None:
        now = time.time()
        with self.transaction():
            self.db.execute(
                "INSERT INTO runs (id, name, created, updated, status, model, method, job_hash, job_toml,"
                " total_steps, pid, managed) VALUES (?, ?, ?, ?, 'created', ?, ?, ?, ?, ?, ?, ?)",
                (run_id, name, now, now, model, method, job_hash, job_toml, total_steps, pid, int(managed)))
            data = {"job_hash": job_hash, "model": model, "method": method, "total_steps": total_steps}
            if reproduces:
                data["reproduces"] = reproduces
            if estimate:
                data["memory_estimate"] = estimate
            self._append_event(run_id, "created", data)

    def update_run(self, run_id: str, **fields: Any) -> None:
        if not fields:
            return
        cols = ", ".join(f"{k}=?" for k in fields)
        with self.transaction():
            self.db.execute(f"UPDATE runs SET {cols}, updated=? WHERE id=?", (*fields.values(), time.time(), run_id))

    def set_status(self, run_id: str, status: str, event: str | None = None, **data: Any) -> None:
        """Change a run's status and record why, in one transaction."""
        with self.transaction():
            self.db.execute("UPDATE runs SET status=?, updated=? WHERE id=?", (status, time.time(), run_id))
            self._append_event(run_id, event or status, data)

    def run(self, run_id: str) -> dict:
        row = self.db.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
        if row is None:
            raise RunNotFound(f"no run `{run_id}`; `lodger ls` lists the runs")
        return dict(row)

    def runs(self) -> list[dict]:
        return [dict(r) for r in self.db.execute("SELECT * FROM runs ORDER BY created")]

    def find_run(self, prefix: str) -> dict:
        """A run by exact id or by unique prefix."""
        rows = self.db.execute("SELECT * FROM runs WHERE id=? OR id LIKE ? ORDER BY created",
                               (prefix, prefix.replace("%", "") + "%")).fetchall()
        exact = [r for r in rows if r["id"] == prefix]
        if exact:
            return dict(exact[0])
        if len(rows) == 1:
            return dict(rows[0])
        if not rows:
            raise RunNotFound(f"no run matches `{prefix}`; `lodger ls` lists the runs")
        ids = ", ".join(r["id"] for r in rows[:5])
        raise RunNotFound(f"`{prefix}` matches {len(rows)} runs ({ids}); give more of the id")

    # -- metrics and provenance --------------------------------------------------------------
    def add_metrics(self, run_id: str, segment: int, records: Iterable[dict]) -> None:
        """Store metric records (each with `kind` and `step`); a re-run step replaces the lost one."""
        rows = [(run_id, r.get("kind", "train"), int(r["step"]), segment, _canonical(r)) for r in records]
        if rows:
            with self.transaction():
                self.db.executemany("INSERT OR REPLACE INTO metrics VALUES (?, ?, ?, ?, ?)", rows)

    def metrics(self, run_id: str, kind: str = "train") -> list[dict]:
        rows = self.db.execute("SELECT data, segment FROM metrics WHERE run_id=? AND kind=? ORDER BY step",
                               (run_id, kind)).fetchall()
        return [{**json.loads(r["data"]), "segment": r["segment"]} for r in rows]

    def add_provenance(self, run_id: str, segment: int, data: dict) -> None:
        with self.transaction():
            self.db.execute("INSERT OR REPLACE INTO provenance VALUES (?, ?, ?, ?)",
                            (run_id, segment, time.time(), _canonical(data)))

    # -- the queue ---------------------------------------------------------------------------
    def enqueue(self, name: str, job_path: str, job_toml: str, priority: int) -> int:
        with self.transaction():
            cursor = self.db.execute("INSERT INTO queue (name, job_path, job_toml, priority, added, state)"
                                     " VALUES (?, ?, ?, ?, ?, 'queued')", (name, job_path, job_toml, priority, time.time()))
            self._append_event(None, "queued", {"queue_id": cursor.lastrowid, "name": name, "priority": priority,
                                                "job_path": job_path})
            return cursor.lastrowid

    def queue(self) -> list[dict]:
        """Queued jobs, the one to start next first (highest priority, then oldest)."""
        rows = self.db.execute("SELECT * FROM queue WHERE state='queued' ORDER BY priority DESC, added, id")
        return [dict(r) for r in rows]

    def take_from_queue(self, queue_id: int, run_id: str) -> bool:
        """Mark a queued job started by ``run_id``; False if someone else took it first."""
        with self.transaction():
            cursor = self.db.execute("UPDATE queue SET state='started', run_id=? WHERE id=? AND state='queued'",
                                     (run_id, queue_id))
            if cursor.rowcount:
                self._append_event(run_id, "dequeued", {"queue_id": queue_id})
            return bool(cursor.rowcount)

    def cancel_queued(self, queue_id: int) -> bool:
        with self.transaction():
            cursor = self.db.execute("UPDATE queue SET state='cancelled' WHERE id=? AND state='queued'", (queue_id,))
            if cursor.rowcount:
                self._append_event(None, "unqueued", {"queue_id": queue_id})
            return bool(cursor.rowcount)

    def provenance(self, run_id: str) -> list[dict]:
        rows = self.db.execute("SELECT segment, data FROM provenance WHERE run_id=? ORDER BY segment",
                               (run_id,)).fetchall()
        return [json.loads(r["data"]) for r in rows]


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, so concurrent writers serialise instead of losing rows."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self):
        self.depth = self.db.in_transaction
        if not self.depth:
            self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type, exc, tb):
        if self.depth:
            return False
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        return False
