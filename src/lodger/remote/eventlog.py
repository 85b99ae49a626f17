"""The remote side's events and metrics: an append-only, hash-chained log in storage (no database).

A remote run cannot share this machine's SQLite ledger, and opening a SQLite file over a network
file system is how ledgers get corrupted. So the remote worker appends records here and
``lodger sync`` reads what it has not seen yet. Each record is one object, never rewritten::

    <prefix>/000000001.json   {"seq": 1, "run_id": ..., "time": ..., "kind": ..., "data": {...},
                               "prev_hash": <anchor>, "hash": ...}

``hash`` is the ledger's own ``event_hash`` over (prev_hash, seq, run_id, repr(time), kind,
canonical data), so a record is hashed exactly as a local ledger event would be. The first record's
``prev_hash`` is the *anchor*: the local ledger's head hash recorded when the job was submitted,
so the remote chain continues the local one. Writes are exclusive (create-only: a rename-less
``link`` locally, ``If-None-Match: *`` on S3), so two writers cannot both claim a sequence number.

``read_new(since_seq, expected_prev_hash)`` returns the records after ``since_seq`` in order and
refuses, naming the sequence number, a gap (a record missing before later ones), an edit (a
record whose hash does not match its content), or a fork (a record that does not continue the
hash the reader already holds).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from ..errors import LodgerError
from ..ledger import event_hash  # the ledger's hashing: a remote record hashes as a local event
from .storage import Storage

_NAME = re.compile(r"^(\d{9,})\.json$")


class ChainError(LodgerError):
    """The remote event log does not continue the chain recorded here (gap, edit or fork)."""


def _canonical(value: Any) -> str:
    # Identical to ledger._canonical (a unit test holds them equal); not imported as it is private.
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def record_hash(record: dict) -> str:
    """The hash a record must carry, from its other fields."""
    return event_hash(record["prev_hash"], record["seq"], record.get("run_id"), record["time"], record["kind"],
                      _canonical(record["data"]))


class EventLog:
    """One run's log under ``prefix`` in ``storage``; ``anchor`` is the hash it continues."""

    def __init__(self, storage: Storage, prefix: str = "events", run_id: str | None = None,
                 anchor: str = "0" * 64):
        self.storage, self.prefix, self.run_id, self.anchor = storage, prefix.strip("/"), run_id, anchor
        self._head: tuple[int, str] | None = None  # (seq, hash) of the newest record, once known

    def key(self, seq: int) -> str:
        return f"{self.prefix}/{seq:09d}.json"

    def head(self) -> tuple[int, str]:
        """(seq, hash) of the newest record, the whole chain verified; (0, anchor) when empty."""
        records = self.read_new(0, self.anchor)
        self._head = (records[-1]["seq"], records[-1]["hash"]) if records else (0, self.anchor)
        return self._head

    def append(self, kind: str, data: dict) -> dict:
        """Write the next record (create-only: an existing sequence number is never overwritten).
        Raises ChainError if another writer took the number (the chain would fork)."""
        seq, prev = self._head if self._head is not None else self.head()
        record = {"seq": seq + 1, "run_id": self.run_id, "time": time.time(), "kind": kind,
                  "data": json.loads(_canonical(data)), "prev_hash": prev}
        record["hash"] = record_hash(record)
        try:
            self.storage.write_bytes(self.key(seq + 1), _canonical(record).encode(), exclusive=True)
        except FileExistsError:
            self._head = None
            raise ChainError(f"{self.storage.uri}/{self.key(seq + 1)}: record {seq + 1} already exists; another "
                             "writer is appending to this log, which lodger does not allow") from None
        self._head = (seq + 1, record["hash"])
        return record

    def _seqs(self) -> list[int]:
        seqs = []
        for name in self.storage.list(self.prefix):
            match = _NAME.match(name)
            if not match:
                raise ChainError(f"{self.storage.uri}/{self.prefix}/{name}: not a record of the event log "
                                 "(records are named <9-digit seq>.json); something else wrote here")
            seqs.append(int(match.group(1)))
        return sorted(seqs)

    def _check_seen(self, seq: int, expected_hash: str) -> None:
        """The newest record this machine took must still be there unchanged: a log rewritten
        from an earlier point is a fork even before anything new follows it."""
        where = f"{self.storage.uri}/{self.key(seq)}"
        try:
            record = json.loads(self.storage.read_bytes(self.key(seq)))
            held = record["hash"]
        except FileNotFoundError:
            raise ChainError(f"{where}: record {seq}, already taken here, is gone from the log (a gap); "
                             "nothing more is taken from it") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ChainError(f"{where}: record {seq} is unreadable ({exc!r})") from None
        if held != expected_hash:
            raise ChainError(f"{where}: record {seq} is not the one taken here (hash {str(held)[:12]}..., "
                             f"recorded {expected_hash[:12]}...): the log forked or was rewritten; nothing "
                             "more is taken from it")

    def read_new(self, since_seq: int, expected_prev_hash: str) -> list[dict]:
        """The records after ``since_seq``, verified to continue ``expected_prev_hash`` (the hash of
        record ``since_seq`` as this machine recorded it, or the anchor for 0). ChainError names
        the sequence number of the first gap, edit or fork."""
        seqs = [s for s in self._seqs() if s > since_seq]
        if since_seq > 0:
            self._check_seen(since_seq, expected_prev_hash)
        out, prev = [], expected_prev_hash
        for want, seq in enumerate(seqs, start=since_seq + 1):
            if seq != want:
                raise ChainError(f"{self.storage.uri}/{self.key(want)}: record {want} is missing but "
                                 f"{seq} exists (a gap in the event log); nothing after {want - 1} is taken")
            where = f"{self.storage.uri}/{self.key(seq)}"
            try:
                record = json.loads(self.storage.read_bytes(self.key(seq)))
                fields = (record["seq"], record["prev_hash"], record["hash"], record["time"], record["kind"],
                          record["data"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ChainError(f"{where}: record {seq} is unreadable ({exc!r}); nothing after {seq - 1} is taken") \
                    from None
            if fields[0] != seq:
                raise ChainError(f"{where}: record {seq} says it is seq {fields[0]!r} (moved or edited)")
            if fields[1] != prev:
                raise ChainError(f"{where}: record {seq} does not continue the chain recorded here (prev_hash "
                                 f"{str(fields[1])[:12]}..., expected {prev[:12]}...): the log forked or was "
                                 "rewritten; nothing from it is taken")
            if fields[2] != record_hash(record):
                raise ChainError(f"{where}: record {seq}'s hash does not match its content (edited after it "
                                 "was written); nothing from it is taken")
            out.append(record)
            prev = fields[2]
        return out


__all__ = ["ChainError", "EventLog", "record_hash"]
