"""The ledger: named ordered migrations, WAL + synchronous=FULL, the hash chain and what audit() catches,
`lodger audit` exit codes, and several processes writing at once without losing an event.

Every test uses a real SQLite file under the test's own LODGER_HOME (set by the autouse fixture).
Tampering is done the way an attacker or a bad tool would: through a raw sqlite3 connection.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import lodger.ledger as ledger_module
from lodger.home import ledger_path
from lodger.ledger import GENESIS, Ledger, event_hash
from lodger.ledger.migrations import MIGRATIONS
from lodger.ledger.values import NewRun

LODGER = str(Path(sys.executable).with_name("lodger"))


# -- small helpers ---------------------------------------------------------------------------
def raw(path: Path | None = None) -> sqlite3.Connection:
    """A plain connection that bypasses the Ledger class (autocommit), as a tampering tool would."""
    db = sqlite3.connect(path or ledger_path(), isolation_level=None)
    db.row_factory = sqlite3.Row
    return db


def filled_ledger(n: int = 6) -> list[int]:
    """A ledger with one run and ``n`` events in all (created + n-1 checkpoints); returns their seqs."""
    with Ledger() as ledger:
        ledger.create_run(NewRun("run-a", name="a", model="m", method="lora", job_hash="h" * 64, job_toml="x = 1\n",
                          total_steps=10, pid=None))
        for step in range(1, n):
            ledger.event("run-a", "checkpoint", step=step, path=f"step-{step:08d}")
        return [e["seq"] for e in ledger.events()]


def audit() -> tuple[int, list[tuple[int, str]]]:
    with Ledger() as ledger:
        count, problems = ledger.audit()
    return count, [(p.seq, p.problem) for p in problems]


def lodger(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([LODGER, *args], capture_output=True, text=True, timeout=timeout)


# -- migrations and pragmas ------------------------------------------------------------------
def test_migrations_are_applied_once_and_recorded_by_name_in_order():
    Ledger().close()
    with raw() as db:
        rows = db.execute("SELECT name, applied FROM migrations ORDER BY rowid").fetchall()
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert [r["name"] for r in rows] == [name for name, _ in MIGRATIONS]
    assert [r["applied"] for r in rows] == sorted(r["applied"] for r in rows)
    assert {"runs", "events", "chain_head", "metrics", "provenance", "migrations"} <= tables


def test_reopening_the_ledger_applies_nothing_again():
    filled_ledger(3)
    with raw() as db:
        before = [tuple(r) for r in db.execute("SELECT name, applied FROM migrations ORDER BY rowid")]
    for _ in range(3):
        Ledger().close()
    with raw() as db:
        after = [tuple(r) for r in db.execute("SELECT name, applied FROM migrations ORDER BY rowid")]
        events = db.execute("SELECT COUNT(*) FROM events").fetchone()[0]
    assert after == before
    assert events == 3  # and no data was touched


def test_a_new_migration_is_applied_after_the_existing_ones_on_next_open(monkeypatch):
    filled_ledger(2)
    extra = ("9999_test_extra_table", "CREATE TABLE extra (x INTEGER); INSERT INTO extra VALUES (7)")
    monkeypatch.setattr(ledger_module, "MIGRATIONS", [*MIGRATIONS, extra])
    Ledger().close()
    Ledger().close()  # and only once
    with raw() as db:
        names = [r[0] for r in db.execute("SELECT name FROM migrations ORDER BY rowid")]
        assert [tuple(r) for r in db.execute("SELECT x FROM extra")] == [(7,)]
    assert names == [name for name, _ in MIGRATIONS] + [extra[0]]


def test_an_older_ledger_is_upgraded_in_place_and_keeps_its_rows(monkeypatch):
    with monkeypatch.context() as m:  # a ledger written by a version that knew only the first migration
        m.setattr(ledger_module, "MIGRATIONS", MIGRATIONS[:1])
        with Ledger() as old:  # rows as that version wrote them: only the first migration's columns
            old.db.execute("INSERT INTO runs (id, name, created, updated, status, total_steps) "
                           "VALUES ('run-a', 'a', 1.0, 1.0, 'finished', 10)")
            for step in (1, 2, 3):
                old.event("run-a", "checkpoint", step=step)
    with Ledger() as ledger:
        assert [e["seq"] for e in ledger.events()] == [1, 2, 3]
        assert ledger.run("run-a")["total_steps"] == 10
        names = [r[0] for r in ledger.db.execute("SELECT name FROM migrations ORDER BY rowid")]
    assert names == [name for name, _ in MIGRATIONS]
    assert audit() == (3, [])


def test_ledger_uses_wal_and_synchronous_full():
    with Ledger() as ledger:
        assert ledger.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert ledger.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # 2 = FULL
    with raw() as db:  # WAL is a property of the file: a fresh connection sees it too
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


# -- the chain -------------------------------------------------------------------------------
def test_each_event_links_to_the_hash_of_the_one_before():
    filled_ledger(5)
    with Ledger() as ledger:
        events = ledger.events()
        head = ledger.db.execute("SELECT seq, hash FROM chain_head").fetchone()
    assert [e["seq"] for e in events] == [1, 2, 3, 4, 5]
    assert events[0]["prev_hash"] == GENESIS
    for before, after in zip(events, events[1:]):
        assert after["prev_hash"] == before["hash"]
    for e in events:
        text = json.dumps(e["data"], sort_keys=True, separators=(",", ":"))
        assert e["hash"] == event_hash(e["prev_hash"], e["seq"], e["run_id"], e["time"], e["kind"], text)
    assert (head["seq"], head["hash"]) == (5, events[-1]["hash"])


def test_an_event_in_a_rolled_back_transaction_leaves_no_trace_in_the_chain():
    filled_ledger(3)
    with Ledger() as ledger:
        with pytest.raises(RuntimeError):
            with ledger.transaction():
                ledger.event("run-a", "checkpoint", step=99)
                raise RuntimeError("the surrounding work failed")
        ledger.event("run-a", "checkpoint", step=4)
        assert [(e["seq"], e["data"].get("step")) for e in ledger.events()][-2:] == [(3, 2), (4, 4)]
    assert audit() == (4, [])


def test_audit_is_clean_on_an_untouched_chain():
    filled_ledger(6)
    assert audit() == (6, [])


def test_audit_is_clean_on_an_empty_ledger():
    assert audit() == (0, [])


def test_audit_catches_an_edited_row():
    filled_ledger(6)
    with raw() as db:
        db.execute("""UPDATE events SET data='{"path":"step-00000003","step":30}' WHERE seq=3""")
    count, problems = audit()
    assert count == 6
    assert [seq for seq, _ in problems] == [3]
    assert "edited" in problems[0][1]


def test_audit_catches_a_row_edited_and_rehashed_by_its_successor_link():
    filled_ledger(6)
    with raw() as db:  # a smarter forger recomputes the row's own hash, but cannot fix the next link
        row = db.execute("SELECT * FROM events WHERE seq=3").fetchone()
        data = '{"path":"step-00000003","step":30}'
        digest = event_hash(row["prev_hash"], 3, row["run_id"], row["time"], row["kind"], data)
        db.execute("UPDATE events SET data=?, hash=? WHERE seq=3", (data, digest))
    _, problems = audit()
    assert [seq for seq, _ in problems] == [4]
    assert "does not link" in problems[0][1]


def test_audit_catches_a_deleted_middle_row():
    filled_ledger(6)
    with raw() as db:
        db.execute("DELETE FROM events WHERE seq=3")
    count, problems = audit()
    assert count == 5
    seqs = [seq for seq, _ in problems]
    assert 3 in seqs and "missing" in dict(problems)[3]
    assert 4 in seqs and "does not link" in dict(problems)[4]


def test_audit_catches_a_deleted_last_row_through_the_chain_head():
    filled_ledger(6)
    with raw() as db:
        db.execute("DELETE FROM events WHERE seq=6")
    count, problems = audit()
    assert count == 5
    assert [seq for seq, _ in problems] == [6]
    assert "should end at row 6" in problems[0][1] and "ends at row 5" in problems[0][1]


def test_audit_catches_a_forged_row_appended_with_a_valid_hash():
    filled_ledger(6)
    with raw() as db:  # plausible seq, correct link and hash; only the chain head is left as it was
        last = db.execute("SELECT * FROM events WHERE seq=6").fetchone()
        at, data = last["time"] + 1.0, '{"step":6}'
        digest = event_hash(last["hash"], 7, "run-a", at, "finished", data)
        db.execute("INSERT INTO events VALUES (7, 'run-a', ?, 'finished', ?, ?, ?)", (at, data, last["hash"], digest))
    count, problems = audit()
    assert count == 7
    assert [seq for seq, _ in problems] == [6]
    assert "ends at row 7" in problems[0][1]


def test_audit_catches_a_forged_row_inserted_in_the_middle():
    filled_ledger(6)
    with raw() as db:  # make room at seq 4 (shift the rest up), forge a linked, self-consistent row there
        for seq in (6, 5, 4):
            db.execute("UPDATE events SET seq=? WHERE seq=?", (seq + 1, seq))
        prev = db.execute("SELECT * FROM events WHERE seq=3").fetchone()
        at, data = prev["time"] + 0.001, '{"reason":"forged","step":3}'
        digest = event_hash(prev["hash"], 4, "run-a", at, "interrupted", data)
        db.execute("INSERT INTO events VALUES (4, 'run-a', ?, 'interrupted', ?, ?, ?)",
                   (at, data, prev["hash"], digest))
    count, problems = audit()
    assert count == 7
    seqs = [seq for seq, _ in problems]
    assert 4 not in seqs  # the forged row itself is consistent ...
    assert 5 in seqs      # ... but the row after it no longer links, and the shifted rows fail their hashes
    assert any("ends at row 7" in p for _, p in problems)


def test_audit_reads_rows_and_chain_head_from_one_snapshot():
    """An append committed by another process while audit() runs must not look like tampering.

    (Regression: rows and chain_head were read in two autocommit SELECTs, two WAL snapshots, so a
    concurrent append made an intact ledger fail `lodger audit`.)"""
    filled_ledger(4)
    ledger = Ledger()
    other = Ledger()

    class WriteBetweenReads:
        """Proxies the connection; commits one event from another connection right after the rows are read."""

        def __init__(self, db):
            self.db, self.fired = db, False

        def execute(self, sql, *args):
            if "FROM chain_head" in sql and not self.fired:
                self.fired = True
                other.event("run-a", "checkpoint", step=99)
            return self.db.execute(sql, *args)

        def __getattr__(self, name):
            return getattr(self.db, name)

    try:
        ledger.db = WriteBetweenReads(ledger.db)
        count, problems = ledger.audit()
        assert ledger.db.fired
        assert problems == [], [(p.seq, p.problem) for p in problems]
    finally:
        ledger.db = getattr(ledger.db, "db", ledger.db)
        ledger.close()
        other.close()


# -- lodger audit ----------------------------------------------------------------------------
def test_lodger_audit_exits_zero_on_an_intact_chain():
    filled_ledger(5)
    result = lodger("audit")
    assert result.returncode == 0, result.stderr
    assert "ledger intact: 5 events" in result.stdout


def test_lodger_audit_exits_nonzero_and_names_the_edited_row():
    filled_ledger(5)
    with raw() as db:
        db.execute("UPDATE events SET kind='finished' WHERE seq=2")
    result = lodger("audit")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "row 2:" in result.stderr and "edited" in result.stderr
    assert "ledger chain broken" in result.stderr


def test_lodger_audit_names_a_deleted_last_row():
    filled_ledger(5)
    with raw() as db:
        db.execute("DELETE FROM events WHERE seq=5")
    result = lodger("audit")
    assert result.returncode == 1
    assert "row 5:" in result.stderr


# -- several processes at once ---------------------------------------------------------------
WRITER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    go, name, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    deadline = time.monotonic() + 60
    while not go.exists():  # start together, so the migrations and the appends really overlap
        if time.monotonic() > deadline:
            sys.exit("no go signal")
        time.sleep(0.001)
    from lodger.ledger import Ledger
    from lodger.ledger.values import NewRun
    with Ledger() as ledger:
        ledger.create_run(NewRun(name, name=name, model="m", method="lora", job_hash="h", job_toml="", total_steps=n,
                          pid=os.getpid()))
        for i in range(n):
            ledger.event(name, "checkpoint", step=i)
    print("done", name)
""")


def test_concurrent_writers_and_a_reader_lose_no_event(tmp_path):
    writers, per_writer = 4, 60
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(go), f"w{k}", str(per_writer)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(writers)]
    try:
        go.touch()
        listings = []
        deadline = time.monotonic() + 120
        while any(p.poll() is None for p in procs) or not listings:  # read while they write (at least once)
            assert time.monotonic() < deadline, "writers did not finish in 120 s"
            listing = lodger("ls", "--json")
            assert listing.returncode == 0, listing.stderr
            listings.append(json.loads(listing.stdout))
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err
    assert all(len(runs) <= writers for runs in listings)

    with Ledger() as ledger:
        events = ledger.events()
        runs = ledger.runs()
    total = writers * (per_writer + 1)  # each writer: one `created` + its appends
    assert len(events) == total
    assert [e["seq"] for e in events] == list(range(1, total + 1))
    assert sorted(r["id"] for r in runs) == [f"w{k}" for k in range(writers)]
    for k in range(writers):  # each writer's own events kept their order
        mine = [e for e in events if e["run_id"] == f"w{k}"]
        assert [e["kind"] for e in mine] == ["created"] + ["checkpoint"] * per_writer
        assert [e["data"]["step"] for e in mine[1:]] == list(range(per_writer))
    assert audit() == (total, [])
    final = lodger("ls", "--json")
    assert sorted(r["id"] for r in json.loads(final.stdout)) == [f"w{k}" for k in range(writers)]


def test_installed_packages_are_read_from_the_metadata_headers_as_importlib_reads_them():
    from importlib import metadata

    from lodger.ledger import provenance

    expected = {d.metadata["Name"].lower(): d.version for d in metadata.distributions() if d.metadata["Name"]}
    assert provenance.packages() == expected and "torch" in expected
