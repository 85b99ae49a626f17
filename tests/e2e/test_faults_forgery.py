"""Faults: a forger with the owner's account, against the ledger, then the real commands.

Two finished tiny runs of one job (A and B, bitwise equal), one more event after them, and a head
witnessed outside the ledger (`lodger audit --witness`). Then, each on a copy of that home:

- the forger edits A's loss at step 2 in the metrics table and in its `metrics` event, and
  recomputes every later hash and the chain head (tests/forge.py): `lodger audit` alone is fooled;
  `lodger audit --against` the witness names the line; `show A --against` puts a WARNING first and
  marks every record after the newest still-witnessed row UNVERIFIED; `compare A B --against` says
  "not trustworthy" instead of a verdict on forged numbers;
- the forger puts back an older copy of ledger.db (taken between the runs and the witness): audit
  --against says the chain was cut off; show and compare mark and refuse alike;
- without a witness, an edit that did not recompute the chain: a metrics row edited in its table, or
  an event edited with only its own hash recomputed: `show` and `compare` name the row themselves.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from forge import rewrite_chain
from helpers import describe, lodger_env, run_lodger, write_job
from lodger.ledger import event_hash
from lodger.ledger.records import metrics_digest

pytestmark = pytest.mark.faults


def _lodger(args, home: Path):
    result = run_lodger([str(a) for a in args], lodger_env(home))
    assert "Traceback" not in result.stderr, describe(result)
    return result


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir, e2e_data):
    root = tmp_path_factory.mktemp("forgery")
    home = root / "home"
    home.mkdir(mode=0o700)
    job = write_job(root / "job.toml", model=tiny_model_dir, train=e2e_data["train"], steps=4, every_steps=2,
                    eval_every=None)
    witness = root / "elsewhere" / "heads.jsonl"
    witness.parent.mkdir()
    runs, older = [], root / "older-ledger.db"
    for n in range(2):
        result = _lodger(["run", job, "--quiet"], home)
        assert result.returncode == 0, describe(result)
        runs.append(result.stdout.split()[1])
        if n == 0:  # line 1: a head witnessed after A, before B
            assert _lodger(["audit", "--witness", witness], home).returncode == 0
    with sqlite3.connect(home / "ledger.db") as db, sqlite3.connect(older) as copy:
        db.backup(copy)  # the copy the second forger puts back later
    added = _lodger(["data", "add", e2e_data["eval"], "--name", "notes", "--license", "CC0-1.0", "--owner", "me"],
                    home)
    assert added.returncode == 0, describe(added)
    assert _lodger(["audit", "--witness", witness], home).returncode == 0  # line 2: the head at the end
    assert _lodger(["compare", runs[0], runs[1]], home).returncode == 0  # bitwise equal, before any forgery
    return {"root": root, "home": home, "a": runs[0], "b": runs[1], "older": older, "witness": witness}


def _copy(world, name: str) -> Path:
    home = world["root"] / name
    shutil.copytree(world["home"], home)
    return home


def _raw(home: Path) -> sqlite3.Connection:
    return sqlite3.connect(home / "ledger.db", isolation_level=None)


def _forge_loss(db: sqlite3.Connection, run_id: str, step: int = 2, loss: float = 0.125) -> int:
    """A's loss at ``step`` changed in its metrics row and in the metrics event covering it; the seq."""
    kind, segment, text = db.execute("SELECT kind, segment, data FROM metrics WHERE run_id=? AND step=? AND "
                                     "kind='train'", (run_id, step)).fetchone()
    row = json.loads(text)
    row["loss"] = loss
    text = json.dumps(row, sort_keys=True, separators=(",", ":"))
    db.execute("UPDATE metrics SET data=? WHERE run_id=? AND step=? AND kind='train'", (text, run_id, step))
    for seq, data in db.execute("SELECT seq, data FROM events WHERE run_id=? AND kind='metrics'", (run_id,)).fetchall():
        data = json.loads(data)
        if f"{kind}:{step}" in data["rows"]:
            data["rows"].update(metrics_digest([(kind, step, segment, text)]))
            db.execute("UPDATE events SET data=? WHERE seq=?", (json.dumps(data, sort_keys=True, separators=(",", ":")),
                                                                seq))
            return seq
    raise AssertionError("no metrics event covers the row")


def _show(home: Path, run_id: str, *extra) -> tuple:
    text = _lodger(["show", run_id, *extra], home)
    info = json.loads(_lodger(["show", run_id, "--json", *extra], home).stdout)
    return text, info


def _assert_marked(text, info, witness: Path) -> None:
    assert text.returncode == 0, describe(text)
    first = text.stderr.splitlines()[0]
    assert first.startswith("WARNING") and "not confirmed by the witness file" in first and str(witness) in first, \
        describe(text)
    assert "UNVERIFIED (see the WARNING)" in text.stdout and "  UNVERIFIED " in text.stdout, describe(text)
    assert info["chain_problems"] and any(not e["verified"] for e in info["events"]), info["chain_problems"]


def _assert_clean(home: Path, run_id: str, witness: Path) -> None:
    text, info = _show(home, run_id, "--against", witness)
    assert "WARNING" not in text.stderr and "UNVERIFIED" not in text.stdout, describe(text)
    assert info["chain_problems"] == [] and all(e["verified"] for e in info["events"])


def test_a_forger_who_recomputes_the_chain_is_caught_by_audit_against_a_witness_and_show_and_compare_mark_it(world):
    """B's loss forged, every later hash recomputed: audit alone fooled; --against names line 2; show marks
    B's records UNVERIFIED (A's, witnessed by line 1, stay confirmed); compare says not trustworthy"""
    home, witness = _copy(world, "rewritten"), world["witness"]
    with _raw(home) as db:
        seq = _forge_loss(db, world["b"])
        rewrite_chain(db, from_seq=seq)
    assert _lodger(["audit"], home).returncode == 0, "the forgery is self-consistent: audit alone cannot see it"
    against = _lodger(["audit", "--against", witness], home)
    assert against.returncode == 1 and f"{witness} line 2: row" in against.stderr and "rewritten at or before" in \
        against.stderr and "line 1:" not in against.stderr, describe(against)
    text, info = _show(home, world["b"], "--against", witness)
    _assert_marked(text, info, witness)
    assert not any(e["verified"] for e in info["events"])
    _assert_clean(home, world["a"], witness)
    compared = _lodger(["compare", world["a"], world["b"], "--against", witness], home)
    assert compared.returncode == 1 and "verdict: not trustworthy" in compared.stdout, describe(compared)


def test_an_older_copy_of_the_ledger_put_back_is_caught_by_audit_against_and_show_and_compare_mark_it(world):
    """audit alone: intact; --against: line 2 cut off (truncated); show marks B's records; compare untrustworthy"""
    home, witness = _copy(world, "older"), world["witness"]
    for suffix in ("", "-wal", "-shm"):
        (home / f"ledger.db{suffix}").unlink(missing_ok=True)
    shutil.copyfile(world["older"], home / "ledger.db")
    assert _lodger(["audit"], home).returncode == 0, "an older ledger is a whole ledger: audit alone cannot see it"
    against = _lodger(["audit", "--against", witness], home)
    assert against.returncode == 1 and f"{witness} line 2: row" in against.stderr and \
        "the chain was cut off (truncated)" in against.stderr, describe(against)
    text, info = _show(home, world["b"], "--against", witness)
    _assert_marked(text, info, witness)
    _assert_clean(home, world["a"], witness)
    compared = _lodger(["compare", world["a"], world["b"], "--against", witness], home)
    assert compared.returncode == 1 and "verdict: not trustworthy" in compared.stdout, describe(compared)


def test_without_a_witness_an_edited_row_or_a_rehashed_event_is_named_by_show_and_compare(world):
    """a metrics row edited in its table, an event edited with only its own hash recomputed: show warns, compare refuses"""
    home = _copy(world, "edited")
    with _raw(home) as db:
        db.execute("UPDATE metrics SET data=json_set(data, '$.loss', 0.5) WHERE run_id=? AND step=1 AND kind='train'",
                   (world["a"],))
        seq, run_id, at, kind, data, prev = db.execute(
            "SELECT seq, run_id, time, kind, data, prev_hash FROM events WHERE run_id=? AND kind='finished'",
            (world["b"],)).fetchone()
        data = json.dumps({**json.loads(data), "eval_loss": 0.01}, sort_keys=True, separators=(",", ":"))
        db.execute("UPDATE events SET data=?, hash=? WHERE seq=?", (data, event_hash(prev, seq, run_id, at, kind, data),
                                                                    seq))
    text_a, _ = _show(home, world["a"])
    assert "WARNING   table metrics, run" in text_a.stderr and "step 1" in text_a.stderr, describe(text_a)
    text_b, _ = _show(home, world["b"])
    assert f"WARNING   table events, row {seq} (finished): the row after it does not link to it" in text_b.stderr, \
        describe(text_b)
    compared = _lodger(["compare", world["a"], world["b"]], home)
    assert compared.returncode == 1 and "verdict: not trustworthy" in compared.stdout, describe(compared)
