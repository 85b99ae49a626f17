"""Every table as a function of the chain: the rules that turn events into rows, used twice.

Writing: ``apply`` runs inside the transaction that appends an event, so a covered column changes
only with the chained event that explains it. Auditing: ``Records`` runs the same rules over the
whole chain and ``Records.compare`` names each row (table, run, step) that does not match.

What the chain covers:

* runs: name, status, model, method, job hash, the job text (its sha256), total steps, step, loss,
  managed, target, remote job id, remote info and the hash of the last remote event-log record
  taken (``remote_log_hash``: `sync` trusts it to check the chain continues). Not covered: pid,
  segment, created/updated times, remote_seq (bookkeeping; the hash above pins the record).
* metrics: each row's hash is carried by the ``metrics`` event that wrote it; truncations are
  ``metrics_truncated`` events.
* provenance: each segment's record hash, in a ``provenance`` event written with the row.
* datasets (every column but the times), the queue (state, run, name, priority, path and the
  sha256 of the job text) and targets (compared with targets.toml by the caller).

Rows written before these rules existed (a ledger upgraded by migration 0005) carry no hashes:
they are reported as not covered, not as tampered, and whatever was chained for them is checked.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
import sqlite3
from collections.abc import Iterable, Mapping
from typing import Any, overload

RUN_COLUMNS = ("name", "status", "model", "method", "job_hash", "total_steps", "step", "loss", "managed",
               "target", "remote_job_id", "remote", "remote_log_hash")
DATASET_COLUMNS = ("path", "sha256", "size", "lines", "license", "owner", "may_train", "may_leave", "targets",
                   "may_federate")
DATASET_KINDS = ("dataset_added", "dataset_updated", "dataset_granted", "dataset_revoked")
QUEUE_KINDS = ("queued", "queue_starting", "queue_started", "dequeued", "queue_requeued", "unqueued",
               "queue_failed", "queue_refused", "queue_priority")
QUEUE_STATES = {"queue_starting": "starting", "queue_started": "started", "dequeued": "started",
                "queue_requeued": "queued", "unqueued": "cancelled", "queue_failed": "failed",
                "queue_refused": "refused"}


@overload
def sha256_text(text: None) -> None: ...


@overload
def sha256_text(text: str | bytes) -> str: ...


def sha256_text(text: str | bytes | None) -> str | None:
    if text is None:
        return None
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def metric_key(kind: str, step: int) -> str:
    return f"{kind}:{int(step)}"


def metric_row_hash(kind: str, step: int, segment: int, data: str) -> str:
    """The one hash of a stored metric row (``data`` is the canonical JSON text the table holds)."""
    return sha256_text(json.dumps([kind, int(step), int(segment), data], separators=(",", ":")))


def metrics_digest(rows: list[tuple[str, int, int, str]]) -> dict[str, str]:
    """{"kind:step": row hash} for rows given as (kind, step, segment, data text): what a
    ``metrics`` event carries, and what audit recomputes from the table."""
    return {metric_key(kind, step): metric_row_hash(kind, step, segment, data) for kind, step, segment, data in rows}


# -- the rules -------------------------------------------------------------------------------
def run_changes(kind: str, data: dict) -> dict[str, Any]:
    """The run columns an event sets (state-independent, so the live table and a replay agree)."""
    changes: dict[str, Any] = {}
    if kind == "created" and "job_toml_sha256" in data:
        changes = {k: data.get(k) for k in ("name", "model", "method", "job_hash", "total_steps")}
        changes.update(managed=int(bool(data.get("managed"))), status="created", step=0, loss=None,
                       target=None, remote_job_id=None, remote=None)
    elif kind == "checkpoint" and "step" in data:
        changes["step"] = data["step"]
        if "loss" in data:
            changes["loss"] = data["loss"]
    elif kind == "run_updated":
        changes.update({k: v for k, v in data.get("fields", {}).items() if k in RUN_COLUMNS})
    if "status" in data and kind != "created":
        changes["status"] = data["status"]
    return changes


def dataset_row(kind: str, data: dict, at: float) -> dict:
    """The datasets row an event writes (whole row for added/updated, permissions for grant/revoke)."""
    perms = data.get("after", data) if kind in ("dataset_granted", "dataset_revoked") else data
    row = {"name": data["name"], "may_train": int(bool(perms["may_train"])), "may_leave": int(bool(perms["may_leave"])),
           "targets": json.dumps(sorted(perms.get("targets", []))), "updated": at,
           # Events written before the federated permission existed carry no flag: it was never granted.
           "may_federate": int(bool(perms.get("may_federate", False)))}
    if kind in ("dataset_added", "dataset_updated"):
        row.update({k: data[k] for k in ("path", "sha256", "size", "lines", "license", "owner")})
        if kind == "dataset_added":
            row["added"] = at
    return row


def queue_changes(kind: str, data: dict, run_id: str | None, at: float) -> dict[str, Any]:
    """The queue columns an event sets (``queued`` rows are inserted by Ledger.enqueue with the text)."""
    if kind == "queued":
        return {"state": "queued", "name": data.get("name"), "priority": data.get("priority"),
                "job_path": data.get("job_path"), "run_id": None}
    if kind == "queue_priority":  # the owner reordered the queue: the entry stays queued
        return {"priority": data.get("priority")}
    changes: dict[str, Any] = {"state": QUEUE_STATES[kind]}
    if kind == "queue_starting":
        changes.update(run_id=data.get("run_id"), agent_pid=data.get("agent_pid"), starting_at=at)
    elif kind in ("queue_started", "dequeued"):
        changes["run_id"] = data.get("run_id", run_id)
    elif kind == "queue_requeued":
        changes.update(run_id=None, agent_pid=None, starting_at=None)
    return changes


def apply(db: sqlite3.Connection, run_id: str | None, kind: str, data: dict, at: float) -> None:
    """Bring the tables in line with one event, inside the transaction that appends it."""
    changes = run_changes(kind, data) if run_id is not None else {}
    if changes:
        cols = ", ".join(f"{k}=?" for k in changes)
        db.execute(f"UPDATE runs SET {cols}, updated=? WHERE id=?", (*changes.values(), at, run_id))
    if kind in DATASET_KINDS:
        row = dataset_row(kind, data, at)
        if kind == "dataset_added":
            db.execute(f"INSERT OR REPLACE INTO datasets ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                       tuple(row.values()))
        else:
            name = row.pop("name")
            db.execute(f"UPDATE datasets SET {', '.join(f'{k}=?' for k in row)} WHERE name=?", (*row.values(), name))
    if kind in QUEUE_KINDS and kind != "queued" and "queue_id" in data:
        qc = queue_changes(kind, data, run_id, at)
        db.execute(f"UPDATE queue SET {', '.join(f'{k}=?' for k in qc)} WHERE id=?", (*qc.values(), data["queue_id"]))


# -- the audit -------------------------------------------------------------------------------
def _same(stored: Any, chained: Any) -> bool:
    """Equal, where a NaN the chain carries counts as equal to the NULL SQLite stores for it."""
    if isinstance(chained, float) and math.isnan(chained):
        return stored is None or (isinstance(stored, float) and math.isnan(stored))
    return stored == chained


@dataclass
class RecordProblem:
    """A row that disagrees with the chain: which table, which run (or dataset, queue entry), which step."""

    table: str
    key: str
    problem: str
    step: int | None = None
    seq: int | None = None      # the event that says otherwise, if there is one

    def where(self) -> str:
        step = f", step {self.step}" if self.step is not None else ""
        return f"table {self.table}, {self.key}{step}"


@dataclass
class Records:
    """What the chain says every table holds (built by replaying events in order)."""

    since_seq: int = 0                       # events up to here were written before rows were chained
    runs: dict[str, dict] = field(default_factory=dict)
    run_seq: dict[tuple[str, str], int] = field(default_factory=dict)   # (run, column) -> event that set it
    job_sha: dict[str, str] = field(default_factory=dict)
    created_seq: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, dict[str, tuple[str, int]]] = field(default_factory=dict)  # run -> key -> (hash, seq)
    provenance: dict[str, dict[int, tuple[str, int]]] = field(default_factory=dict)
    segment_step: dict[tuple[str, int], int | None] = field(default_factory=dict)
    datasets: dict[str, dict] = field(default_factory=dict)
    queue: dict[int, dict] = field(default_factory=dict)
    targets: dict[str, dict] = field(default_factory=dict)

    def replay(self, events: Iterable[Mapping[str, Any]]) -> "Records":
        for e in events:
            data = e["data"] if isinstance(e["data"], dict) else json.loads(e["data"])
            self.add(e["seq"], e["run_id"], e["kind"], data, e["time"])
        return self

    def add(self, seq: int, run_id: str | None, kind: str, data: dict, at: float) -> None:
        if run_id is not None:
            if kind == "created":
                self.created_seq[run_id] = seq
                if "job_toml_sha256" in data:
                    self.runs[run_id] = {}
                    self.job_sha[run_id] = data["job_toml_sha256"]
            if run_id in self.runs:
                for column, value in run_changes(kind, data).items():
                    self.runs[run_id][column] = value
                    self.run_seq[(run_id, column)] = seq
            if kind == "metrics":
                rows = self.metrics.setdefault(run_id, {})
                rows.update({k: (h, seq) for k, h in data.get("rows", {}).items()})
            elif kind == "metrics_truncated":
                rows = self.metrics.setdefault(run_id, {})
                after = int(data["after_step"])
                dropped = metric_key("eval", after) if data.get("eval_dropped") else None
                for k in [k for k in rows if int(k.split(":")[1]) > after or k == dropped]:
                    del rows[k]
            elif kind == "provenance":
                self.provenance.setdefault(run_id, {})[int(data["segment"])] = (data["sha256"], seq)
            elif kind in ("started", "resumed") and "segment" in data:
                self.segment_step[(run_id, int(data["segment"]))] = data.get("step")
        if kind in DATASET_KINDS:
            row = dataset_row(kind, data, at)
            row.pop("updated")
            row.pop("added", None)
            self.datasets.setdefault(row["name"], {}).update({**row, "seq": seq})
        elif kind in QUEUE_KINDS and "queue_id" in data:
            entry = self.queue.setdefault(int(data["queue_id"]), {})
            entry.update(queue_changes(kind, data, run_id, at), seq=seq)
            entry.pop("starting_at", None)
            entry.pop("agent_pid", None)
            if kind == "queued":
                entry.update(job_sha256=data.get("job_sha256"), queued_seq=seq)
        elif kind == "target_added":
            self.targets[data["name"]] = {"target": data["target"], "seq": seq}
        elif kind == "target_removed":
            self.targets.pop(data["name"], None)

    # -- comparing with the tables ------------------------------------------------------------
    def legacy_run(self, run_id: str) -> bool:
        """A run recorded before rows were chained (its columns were never covered)."""
        return self.since_seq > 0 and run_id not in self.runs and self.created_seq.get(run_id, 0) <= self.since_seq

    def compare_runs(self, rows: list[dict]) -> list[RecordProblem]:
        problems = []
        present = {r["id"] for r in rows}
        for row in rows:
            rid = row["id"]
            if rid not in self.runs:
                if not self.legacy_run(rid):
                    problems.append(RecordProblem("runs", f"run {rid}", "has no `created` event in the chain "
                                                  "(the row was inserted outside lodger)"))
                continue
            for column, value in self.runs[rid].items():
                if not _same(row.get(column), value):
                    problems.append(RecordProblem("runs", f"run {rid}", f"column {column} is {row.get(column)!r} "
                                                  f"but the chain says {value!r}", seq=self.run_seq.get((rid, column))))
            if sha256_text(row.get("job_toml")) != self.job_sha[rid]:
                problems.append(RecordProblem("runs", f"run {rid}", "column job_toml does not match the sha256 in "
                                              "its `created` event (the job text was edited)",
                                              seq=self.created_seq[rid]))
        for rid in self.runs.keys() - present:
            problems.append(RecordProblem("runs", f"run {rid}", "is in the chain but its row is gone (deleted)",
                                          seq=self.created_seq[rid]))
        return problems

    def compare_metrics(self, rows: list[tuple[str, str, int, int, str]]) -> list[RecordProblem]:
        """``rows``: (run_id, kind, step, segment, data text) of the whole metrics table."""
        problems, seen = [], set()
        for run_id, kind, step, segment, data in rows:
            key = metric_key(kind, step)
            seen.add((run_id, key))
            expected = self.metrics.get(run_id, {}).get(key)
            if expected is None:
                if not self.legacy_run(run_id):
                    problems.append(RecordProblem("metrics", f"run {run_id}", f"the {kind} row is not covered by any "
                                                  "chained `metrics` event (inserted outside lodger)", step=step))
            elif metric_row_hash(kind, step, segment, data) != expected[0]:
                problems.append(RecordProblem("metrics", f"run {run_id}", f"the {kind} row does not match the hash "
                                              f"its `metrics` event carries (edited)", step=step, seq=expected[1]))
        for run_id, keys in self.metrics.items():
            for key, (_, seq) in keys.items():
                if (run_id, key) not in seen:
                    kind, at_step = key.split(":")
                    problems.append(RecordProblem("metrics", f"run {run_id}", f"the {kind} row recorded by the chain "
                                                  "is gone (deleted)", step=int(at_step), seq=seq))
        return problems

    def compare_provenance(self, rows: list[tuple[str, int, str]]) -> list[RecordProblem]:
        problems, seen = [], set()
        for run_id, segment, data in rows:
            seen.add((run_id, segment))
            expected = self.provenance.get(run_id, {}).get(segment)
            where = f"run {run_id}, segment {segment}"
            step = self.segment_step.get((run_id, segment))
            if expected is None:
                if not self.legacy_run(run_id):
                    problems.append(RecordProblem("provenance", where, "is not covered by any chained `provenance` "
                                                  "event (inserted outside lodger)", step=step))
            elif sha256_text(data) != expected[0]:
                problems.append(RecordProblem("provenance", where, "does not match the sha256 in its `provenance` "
                                              "event (edited)", step=step, seq=expected[1]))
        for run_id, segments in self.provenance.items():
            for segment, (_, seq) in segments.items():
                if (run_id, segment) not in seen:
                    problems.append(RecordProblem("provenance", f"run {run_id}, segment {segment}",
                                                  "is in the chain but its row is gone (deleted)", seq=seq))
        return problems

    def compare_datasets(self, rows: list[dict]) -> list[RecordProblem]:
        problems = []
        for row in rows:
            name = row["name"]
            expected = self.datasets.get(name)
            if expected is None:
                problems.append(RecordProblem("datasets", f"dataset {name!r}", "has no `dataset_added` event in the "
                                              "chain (inserted outside lodger)"))
                continue
            for column in DATASET_COLUMNS:
                if column in expected and row[column] != expected[column]:
                    problems.append(RecordProblem("datasets", f"dataset {name!r}", f"column {column} is "
                                                  f"{row[column]!r} but the chain says {expected[column]!r}",
                                                  seq=expected["seq"]))
        for name in self.datasets.keys() - {r["name"] for r in rows}:
            problems.append(RecordProblem("datasets", f"dataset {name!r}", "is in the chain but its row is gone "
                                          "(deleted)", seq=self.datasets[name]["seq"]))
        return problems

    def compare_queue(self, rows: list[dict]) -> list[RecordProblem]:
        problems = []
        for row in rows:
            qid = row["id"]
            expected = self.queue.get(qid)
            if expected is None or "queued_seq" not in expected:
                problems.append(RecordProblem("queue", f"queue entry #{qid}", "has no `queued` event in the chain "
                                              "(inserted outside lodger)"))
                continue
            if expected["queued_seq"] <= self.since_seq:
                continue  # queued before transitions were chained: its text has no hash to check against
            for column in ("state", "name", "priority", "job_path", "run_id"):
                if row[column] != expected.get(column):
                    problems.append(RecordProblem("queue", f"queue entry #{qid}", f"column {column} is "
                                                  f"{row[column]!r} but the chain says {expected.get(column)!r}",
                                                  seq=expected["seq"]))
            if expected.get("job_sha256") and sha256_text(row["job_toml"]) != expected["job_sha256"]:
                problems.append(RecordProblem("queue", f"queue entry #{qid}", "column job_toml does not match the "
                                              "sha256 in its `queued` event (the job text was edited)"))
        return problems

    def compare_targets(self, current: dict[str, dict]) -> list[RecordProblem]:
        """``current``: each target in targets.toml as the JSON-ready dict `target_added` records."""
        problems = []
        for name, target in current.items():
            expected = self.targets.get(name)
            if expected is None:
                problems.append(RecordProblem("targets", f"target {name!r}", "is in targets.toml but no "
                                              "`target_added` event records it (added by hand? record it with "
                                              "`lodger target add ... --replace`)"))
            elif target_differences(expected["target"], target):
                changed = target_differences(expected["target"], target)
                problems.append(RecordProblem("targets", f"target {name!r}", f"targets.toml differs from the chain "
                                              f"in {', '.join(changed)} (edited by hand? record it with `lodger "
                                              "target add ... --replace`)", seq=expected["seq"]))
        for name in self.targets.keys() - current.keys():
            problems.append(RecordProblem("targets", f"target {name!r}", "is in the chain but not in targets.toml "
                                          "(removed by hand)", seq=self.targets[name]["seq"]))
        return problems


def target_differences(recorded: dict, current: dict) -> list[str]:
    """Keys where targets.toml differs from the recorded target (a key the record predates counts
    only when it is set)."""
    return sorted(k for k in set(recorded) | set(current)
                  if (current.get(k) != recorded[k] if k in recorded else current.get(k) is not None))
