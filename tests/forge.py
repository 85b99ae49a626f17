"""What a forger with write access to ledger.db does after editing an event: recompute the hash of
every later row and the chain head, so that the chain is self-consistent again (tests use it to
show what `lodger audit` alone cannot catch and a witness file can)."""

from __future__ import annotations

import sqlite3

from lodger.ledger import GENESIS, event_hash


def rewrite_chain(db: sqlite3.Connection, from_seq: int = 1) -> None:
    """Recompute prev_hash and hash of every event from ``from_seq`` on, and the chain head."""
    before = db.execute("SELECT hash FROM events WHERE seq<? ORDER BY seq DESC LIMIT 1", (from_seq,)).fetchone()
    prev = before[0] if before else GENESIS
    rows = db.execute("SELECT seq, run_id, time, kind, data FROM events WHERE seq>=? ORDER BY seq",
                      (from_seq,)).fetchall()
    last = None
    for seq, run_id, at, kind, data in rows:
        digest = event_hash(prev, seq, run_id, at, kind, data)
        db.execute("UPDATE events SET prev_hash=?, hash=? WHERE seq=?", (prev, digest, seq))
        prev, last = digest, seq
    if last is not None:
        db.execute("UPDATE chain_head SET seq=?, hash=? WHERE id=1", (last, prev))
