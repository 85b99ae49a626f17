"""The ledger: an append-only, hash-chained record of runs, events, metrics and provenance.

SQLite in WAL mode with synchronous=FULL. Every event row carries the hash of the previous row;
``audit()`` finds an edited, deleted or inserted row. Every other table is derived from or
covered by chained events (``records.py``: the rules); ``audit_records()`` names each row that
disagrees. Heads witnessed outside the database (``witness.py``) catch a forger who recomputes
the whole chain. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal

from .. import durable
from ..errors import DiskFull, LedgerError, RunNotFound
from ..home import ledger_path
from .known import connect_known
from . import records
from .migrations import MIGRATIONS
from .records import RecordProblem, metrics_digest, sha256_text
from .values import NewRun

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
            self.db = connect_known(self.path)
            self._migrate()
        except sqlite3.DatabaseError as exc:
            if _is_full(exc):
                raise _disk_full(self.path) from None
            raise LedgerError(f"{self.path}: cannot open the ledger: {exc}") from None

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
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
        records.apply(self.db, run_id, kind, data, at)  # the rows this event explains change with it
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

    def event_hash_at(self, seq: int) -> str | None:
        """The hash of event row ``seq`` (None: no such row)."""
        row = self.db.execute("SELECT hash FROM events WHERE seq=?", (seq,)).fetchone()
        return row["hash"] if row else None

    def transaction(self) -> "_Transaction":
        return _Transaction(self.db, self.path)

    def events(self, run_id: str | None = None) -> list[dict]:
        sql, args = "SELECT * FROM events", ()  # type: tuple[str, tuple]
        if run_id is not None:
            sql, args = sql + " WHERE run_id=?", (run_id,)
        rows = self.db.execute(sql + " ORDER BY seq", args).fetchall()
        return [{**dict(r), "data": json.loads(r["data"])} for r in rows]

    def run_events_after(self, run_id: str, kind: str, after_seq: int = 0) -> list[dict]:
        """``run_id``'s events of ``kind`` after row ``after_seq``, in chain order, data decoded
        (what a run reads as it goes, e.g. its new checkpoint times: ckpt_interval.py)."""
        rows = self.db.execute("SELECT * FROM events WHERE run_id=? AND kind=? AND seq>? ORDER BY seq",
                               (run_id, kind, after_seq)).fetchall()
        return [{**dict(r), "data": json.loads(r["data"])} for r in rows]

    def harness_evals(self, run_id: str) -> list[dict]:
        """``run_id``'s lm-eval scores, oldest first: one chained `harness_eval` event per model that
        `lodger eval` scored (the event is the record; no table is derived from it)."""
        return self.run_events_after(run_id, "harness_eval")

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
    def create_run(self, run: NewRun) -> None:
        """The run's row and its `created` event (ledger/values.py's record, as it is)."""
        now = time.time()
        with self.transaction():
            self.db.execute(
                "INSERT INTO runs (id, name, created, updated, status, model, method, job_hash, job_toml,"
                " total_steps, pid, managed) VALUES (?, ?, ?, ?, 'created', ?, ?, ?, ?, ?, ?, ?)",
                (run.run_id, run.name, now, now, run.model, run.method, run.job_hash, run.job_toml, run.total_steps,
                 run.pid, int(run.managed)))
            data = {"job_hash": run.job_hash, "model": run.model, "method": run.method, "total_steps": run.total_steps,
                    "name": run.name, "managed": bool(run.managed), "job_toml_sha256": sha256_text(run.job_toml)}
            if run.reproduces:
                data["reproduces"] = run.reproduces
            if run.estimate:
                data["memory_estimate"] = run.estimate
            self._append_event(run.run_id, "created", data)

    def update_run(self, run_id: str, **fields: Any) -> None:
        """Set run columns; a change to a column the chain covers is a `run_updated` event."""
        if not fields:
            return
        with self.transaction():
            row = self.db.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
            covered = {k: v for k, v in fields.items() if k in records.RUN_COLUMNS}
            changed = {k: v for k, v in covered.items() if row is None or row[k] != v}
            if changed:
                self._append_event(run_id, "run_updated", {"fields": changed})
            rest = {k: v for k, v in fields.items() if k not in covered}
            if rest:
                cols = ", ".join(f"{k}=?" for k in rest)
                self.db.execute(f"UPDATE runs SET {cols}, updated=? WHERE id=?", (*rest.values(), time.time(), run_id))

    def set_status(self, run_id: str, status: str, event: str | None = None, **data: Any) -> None:
        """Change a run's status and record why: the event carries the status and sets the column."""
        with self.transaction():
            self._append_event(run_id, event or status, {**data, "status": status})

    def run(self, run_id: str) -> dict:
        row = self.db.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
        if row is None:
            raise RunNotFound(f"no run `{run_id}`; `lodger ls` lists the runs")
        return dict(row)

    def has_run(self, run_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM runs WHERE id=?", (run_id,)).fetchone() is not None

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
    def add_metrics(self, run_id: str, segment: int, rows: Iterable[dict]) -> None:
        """Store metric records (each with `kind` and `step`); a re-run step replaces the lost one.

        A `metrics` event in the same transaction carries each row's hash (``metrics_digest``), so
        whoever writes rows (a checkpoint, a sync, a re-ingest) leaves them covered by the chain."""
        stored = [(run_id, r.get("kind", "train"), int(r["step"]), segment, _canonical(r)) for r in rows]
        if not stored:
            return
        with self.transaction():
            have = {(r[0], r[1], r[2], r[3]) for r in self.db.execute(
                "SELECT kind, step, segment, data FROM metrics WHERE run_id=? AND step BETWEEN ? AND ?",
                (run_id, min(r[2] for r in stored), max(r[2] for r in stored)))}
            stored = [r for r in stored if r[1:] not in have]  # a repeated sync rewrites nothing
            if stored:
                self.db.executemany("INSERT OR REPLACE INTO metrics VALUES (?, ?, ?, ?, ?)", stored)
                self._append_event(run_id, "metrics", {"segment": segment,
                                                       "rows": metrics_digest([r[1:] for r in stored])})

    def truncate_metrics(self, run_id: str, after_step: int, eval_kept: bool = True) -> int:
        """Delete the run's metric rows after ``after_step`` (work lost with a process), and with
        ``eval_kept`` false the eval row at ``after_step`` too (the restored state has no result for
        it: it runs again); a `metrics_truncated` event records it. Returns how many rows went."""
        with self.transaction():
            gone = self.db.execute("DELETE FROM metrics WHERE run_id=? AND (step>? OR (step=? AND kind='eval' AND ?))",
                                   (run_id, after_step, after_step, not eval_kept)).rowcount
            if gone:
                # the audit's replay drops the eval row too when the event says so (records.py)
                dropped: dict[str, Any] = {} if eval_kept else {"eval_dropped": True}
                self._append_event(run_id, "metrics_truncated", {"after_step": after_step, "rows": gone, **dropped})
        return gone

    def metrics(self, run_id: str, kind: str = "train") -> list[dict]:
        rows = self.db.execute("SELECT data, segment FROM metrics WHERE run_id=? AND kind=? ORDER BY step",
                               (run_id, kind)).fetchall()
        return [{**json.loads(r["data"]), "segment": r["segment"]} for r in rows]

    def add_provenance(self, run_id: str, segment: int, data: dict) -> str:
        """Store a segment's provenance; a `provenance` event carries its sha256. Returns the sha256."""
        text = _canonical(data)
        with self.transaction():
            self.db.execute("INSERT OR REPLACE INTO provenance VALUES (?, ?, ?, ?)",
                            (run_id, segment, time.time(), text))
            self._append_event(run_id, "provenance", {"segment": segment, "sha256": sha256_text(text)})
        return sha256_text(text)

    # -- the queue ---------------------------------------------------------------------------
    def enqueue(self, name: str, job_path: str, job_toml: str, priority: int) -> int:
        """Queue a job; its `queued` event carries the sha256 of the text the agent will run."""
        with self.transaction():
            cursor = self.db.execute("INSERT INTO queue (name, job_path, job_toml, priority, added, state)"
                                     " VALUES (?, ?, ?, ?, ?, 'queued')", (name, job_path, job_toml, priority, time.time()))
            self._append_event(None, "queued", {"queue_id": cursor.lastrowid, "name": name, "priority": priority,
                                                "job_path": job_path, "job_sha256": sha256_text(job_toml)})
            return int(cursor.lastrowid or 0)  # an INSERT's rowid: never None after it

    def queue(self, state: str = "queued") -> list[dict]:
        """Entries in ``state``; for `queued`, the one to start next first (highest priority, then oldest)."""
        rows = self.db.execute("SELECT * FROM queue WHERE state=? ORDER BY priority DESC, added, id", (state,))
        return [dict(r) for r in rows]

    def queue_entry(self, queue_id: int) -> dict | None:
        row = self.db.execute("SELECT * FROM queue WHERE id=?", (queue_id,)).fetchone()
        return dict(row) if row else None

    def queue_move(self, queue_id: int, kind: str, from_states: tuple[str, ...], event_run: str | None = None,
                   **data: Any) -> bool:
        """One queue transition (an event that sets the row), only from ``from_states``; False when the
        entry is not in one of them (someone else moved it first)."""
        with self.transaction():
            row = self.db.execute("SELECT state FROM queue WHERE id=?", (queue_id,)).fetchone()
            if row is None or row["state"] not in from_states:
                return False
            self._append_event(event_run, kind, {"queue_id": queue_id, **data})
            return True

    def take_from_queue(self, queue_id: int, run_id: str, agent_pid: int | None = None) -> bool:
        """queued -> starting: ``run_id`` is the id the run will have; False if someone else took it first."""
        return self.queue_move(queue_id, "queue_starting", ("queued",), run_id=run_id, agent_pid=agent_pid)

    def cancel_queued(self, queue_id: int) -> bool:
        return self.queue_move(queue_id, "unqueued", ("queued",))

    def set_queue_priority(self, queue_id: int, priority: int) -> bool:
        """A queued job's new priority (higher starts first); False once it is no longer queued."""
        return self.queue_move(queue_id, "queue_priority", ("queued",), priority=priority)

    def queue_text_problem(self, queue_id: int, text: str | None = None) -> str | None:
        """Why entry ``queue_id``'s job text (or ``text``, the copy about to run) is not what was
        queued; None when it matches the sha256 its `queued` event carries."""
        entry = self.queue_entry(queue_id)
        if entry is None:
            return f"no queue entry #{queue_id}"
        text = entry["job_toml"] if text is None else text
        for e in self._events_of_kinds(("queued",)):
            data = json.loads(e["data"])
            if data.get("queue_id") != queue_id:
                continue
            if event_hash(e["prev_hash"], e["seq"], e["run_id"], e["time"], e["kind"], e["data"]) != e["hash"]:
                return f"its `queued` event (row {e['seq']}) does not match its own hash (edited)"
            if data.get("job_sha256") is None:
                return ("it was queued before lodger recorded the sha256 of queued jobs; remove it "
                        f"(`lodger queue rm {queue_id}`) and queue the job again")
            if data["job_sha256"] != sha256_text(text):
                return (f"its job text (sha256 {sha256_text(text)}) is not the text that was queued "
                        f"(sha256 {data['job_sha256']}, event row {e['seq']}): it was edited in the ledger")
            return None
        return "no `queued` event records it (the entry was inserted outside lodger)"

    def events_of_kinds(self, kinds: tuple[str, ...]) -> list[dict]:
        """Every event of these kinds, in chain order, with its data decoded (an indexed lookup)."""
        return [{**dict(r), "data": json.loads(r["data"])} for r in self._events_of_kinds(kinds)]

    def _events_of_kinds(self, kinds: tuple[str, ...]) -> list[sqlite3.Row]:
        marks = ", ".join("?" * len(kinds))
        return self.db.execute(f"SELECT * FROM events WHERE kind IN ({marks}) ORDER BY seq", kinds).fetchall()

    # -- datasets (rows written by their events: records.apply) ------------------------------
    def datasets(self) -> list[dict]:
        return [dict(r) for r in self.db.execute("SELECT * FROM datasets ORDER BY name")]

    def dataset_problems(self) -> list[RecordProblem]:
        """Dataset rows that disagree with the chain's dataset events (which must match their own
        hashes): what the gate refuses to trust."""
        rows = self._events_of_kinds(records.DATASET_KINDS)
        problems = [RecordProblem("datasets", f"dataset {json.loads(e['data']).get('name')!r}",
                                  f"its `{e['kind']}` event (row {e['seq']}) does not match its own hash (edited)",
                                  seq=e["seq"])
                    for e in rows if event_hash(e["prev_hash"], e["seq"], e["run_id"], e["time"], e["kind"],
                                                e["data"]) != e["hash"]]
        derived = records.Records().replay([dict(e) for e in rows])
        return problems + derived.compare_datasets(self.datasets())

    # -- what the chain covers ---------------------------------------------------------------
    def chain_targets(self) -> dict[str, dict]:
        """Each target as its last `target_added` event recorded it (removed ones left out)."""
        derived = records.Records().replay([dict(e) for e in self._events_of_kinds(("target_added", "target_removed"))])
        return {name: t["target"] for name, t in derived.targets.items()}

    def audit_records(self, targets: dict[str, dict] | None = None) -> list[RecordProblem]:
        """Recompute every table from the chain; each row that disagrees, with table, run and step.

        ``targets``: targets.toml as JSON-ready dicts, to compare with the chain (None: skip)."""
        self.db.execute("BEGIN")  # one snapshot of the chain and every table
        try:
            events = [dict(r) for r in self.db.execute("SELECT * FROM events ORDER BY seq")]
            since = self.db.execute("SELECT since_seq FROM chain_records WHERE id=1").fetchone()
            runs = [dict(r) for r in self.db.execute("SELECT * FROM runs")]
            metrics = [tuple(r) for r in self.db.execute("SELECT run_id, kind, step, segment, data FROM metrics")]
            prov = [tuple(r) for r in self.db.execute("SELECT run_id, segment, data FROM provenance")]
            datasets, queue = self.datasets(), [dict(r) for r in self.db.execute("SELECT * FROM queue")]
        finally:
            self.db.execute("COMMIT")
        derived = records.Records(since_seq=since[0] if since else 0).replay(events)
        problems = (derived.compare_runs(runs) + derived.compare_metrics(metrics) + derived.compare_provenance(prov)
                    + derived.compare_datasets(datasets) + derived.compare_queue(queue))
        if targets is not None:
            problems += derived.compare_targets(targets)
        return problems

    def run_problems(self, run_ids: list[str]) -> list[RecordProblem]:
        """What `audit_records` would say about these runs' rows only (run, metrics, provenance).

        For readers that print or judge a run (`show`, `compare`): they must not trust a row the
        chain does not confirm. Cheap: it replays only these runs' events."""
        marks = ",".join("?" * len(run_ids))
        self.db.execute("BEGIN")
        try:
            events = [dict(r) for r in self.db.execute(
                f"SELECT * FROM events WHERE run_id IN ({marks}) ORDER BY seq", run_ids)]
            since = self.db.execute("SELECT since_seq FROM chain_records WHERE id=1").fetchone()
            runs = [dict(r) for r in self.db.execute(f"SELECT * FROM runs WHERE id IN ({marks})", run_ids)]
            metrics = [tuple(r) for r in self.db.execute(
                f"SELECT run_id, kind, step, segment, data FROM metrics WHERE run_id IN ({marks})", run_ids)]
            prov = [tuple(r) for r in self.db.execute(
                f"SELECT run_id, segment, data FROM provenance WHERE run_id IN ({marks})", run_ids)]
            links = {r["seq"]: (r["prev_hash"], r["hash"]) for r in self.db.execute(
                f"SELECT seq, prev_hash, hash FROM events WHERE seq IN (SELECT seq - 1 FROM events WHERE run_id IN "
                f"({marks}) UNION SELECT seq + 1 FROM events WHERE run_id IN ({marks}))", run_ids + run_ids)}
        finally:
            self.db.execute("COMMIT")
        derived = records.Records(since_seq=since[0] if since else 0).replay(events)
        return (_chain_problems(events, links) + derived.compare_runs(runs) + derived.compare_metrics(metrics)
                + derived.compare_provenance(prov))

    def last_event(self, run_id: str, kind: str) -> dict | None:
        row = self.db.execute("SELECT * FROM events WHERE run_id=? AND kind=? ORDER BY seq DESC LIMIT 1",
                              (run_id, kind)).fetchone()
        return {**dict(row), "data": json.loads(row["data"])} if row else None

    def provenance(self, run_id: str) -> list[dict]:
        rows = self.db.execute("SELECT segment, data FROM provenance WHERE run_id=? ORDER BY segment",
                               (run_id,)).fetchall()
        return [json.loads(r["data"]) for r in rows]


def _chain_problems(events: list[dict], links: dict[int, tuple[str, str]]) -> list[RecordProblem]:
    """The chain where it touches these events: each one's hash over its content, and its links to
    the rows on either side (``links``: their prev_hash and hash). An event edited in place, or
    edited with its own hash recomputed but not the rest of the chain, is named; a forger who
    recomputes every later hash is not (only a witness catches that: witness.py)."""
    problems = []
    for e in events:
        seq, why = e["seq"], None
        if event_hash(e["prev_hash"], seq, e["run_id"], e["time"], e["kind"], e["data"]) != e["hash"]:
            why = "its content does not match its hash (edited)"
        elif seq > 1 and (seq - 1 not in links or links[seq - 1][1] != e["prev_hash"]):
            why = "does not link to the row before it (that row was changed or deleted)"
        elif seq + 1 in links and links[seq + 1][0] != e["hash"]:
            why = "the row after it does not link to it (it was rewritten)"
        if why:
            problems.append(RecordProblem("events", f"row {seq} ({e['kind']})", why, seq=seq))
    return problems


LEDGER_ROOM = 1 << 20
"""Free space that is ample for one command's ledger writes (a transaction adds a few 4 KiB pages
to the write-ahead log); what a full-disk error asks for."""


def _is_full(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.Error) and (getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
                                               or "database or disk is full" in str(exc))


def _disk_full(path: Path) -> DiskFull:
    return durable.disk_full(path, LEDGER_ROOM, "the ledger; nothing of this write was recorded, "
                                                "what it held before is intact")


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, so concurrent writers serialise instead of losing rows. A full disk
    (SQLite's SQLITE_FULL) rolls the whole transaction back and is a DiskFull naming ledger.db."""

    def __init__(self, db: sqlite3.Connection, path: Path):
        self.db, self.path = db, path

    def __enter__(self) -> sqlite3.Connection:
        self.depth = self.db.in_transaction
        if not self.depth:
            try:
                self.db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if _is_full(exc):
                    raise _disk_full(self.path) from None
                raise
        return self.db

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> Literal[False]:
        if self.depth:
            return False
        try:
            if not exc_type:
                self.db.execute("COMMIT")
            elif self.db.in_transaction:  # SQLite may have rolled back already (a full disk can)
                self.db.execute("ROLLBACK")
        except sqlite3.OperationalError as failed:
            if not _is_full(failed):
                raise
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise _disk_full(self.path) from None
        if exc is not None and _is_full(exc):
            raise _disk_full(self.path) from None
        return False
