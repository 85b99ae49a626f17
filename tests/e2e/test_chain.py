"""One chain for every record, tried the way a forger would: through a raw sqlite3 connection to
the real ledger.db, then the real `lodger` command.

* a finished run's metric loss and provenance sha256 edited in their tables: `lodger audit` names
  the table, the run and the step;
* a `may_leave` flipped in the datasets table: `lodger audit` names it, `lodger submit` refuses;
* a queued job's text edited in the queue table: the agent refuses to run it (event + message);
* a whole chain rewritten with recomputed hashes, or cut short: `lodger audit` alone cannot tell,
  `lodger audit --against` a witness file taken earlier does, naming the witness line.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from forge import rewrite_chain
from helpers import describe, lodger_env, run_lodger, wait_until, write_job

ADDRESS = "http://127.0.0.1:9"  # the discard port: nothing listens there
LIMITS = {"wall_hours": 1.0, "gpu_hours": 1.0, "cost": 1.5, "nodes": 1}
CAPS = ["--wall-hours", "2", "--gpu-hours", "2", "--cost-per-gpu-hour", "1.5", "--budget", "10", "--nodes", "1",
        "--gpus-per-node", "1", "--memory-gb-per-node", "80", "--tflops", "100"]


def lodger(args: list, home: Path, ok: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    result = run_lodger([str(a) for a in args], lodger_env(home), timeout=timeout)
    if ok:
        assert result.returncode == 0, describe(result)
    assert "Traceback" not in result.stderr, describe(result)
    return result


def raw(home: Path) -> sqlite3.Connection:
    db = sqlite3.connect(home / "ledger.db", isolation_level=None)
    db.row_factory = sqlite3.Row
    return db


def kinds(home: Path, kind: str) -> list[dict]:
    with raw(home) as db:
        rows = db.execute("SELECT run_id, data FROM events WHERE kind=? ORDER BY seq", (kind,)).fetchall()
    return [{"run_id": r["run_id"], **json.loads(r["data"])} for r in rows]


@pytest.fixture
def finished_run(tmp_path: Path, lodger_home: Path, tiny_model_dir: Path, chat_data: dict[str, Path]) -> str:
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=chat_data["train"], eval=chat_data["eval"],
                    steps=6, every_steps=2, eval_every=3)
    lodger(["run", job, "--quiet"], lodger_home)
    [run] = json.loads(lodger(["ls", "--json"], lodger_home).stdout)
    assert run["status"] == "finished"
    return run["id"]


def test_a_real_run_audits_clean_and_edited_metrics_and_provenance_are_named(lodger_home: Path,
                                                                             finished_run: str) -> None:
    clean = lodger(["audit"], lodger_home)
    assert "every table agrees with the chain" in clean.stdout
    with raw(lodger_home) as db:
        row = db.execute("SELECT data FROM metrics WHERE run_id=? AND kind='train' AND step=3",
                         (finished_run,)).fetchone()
        forged = {**json.loads(row["data"]), "loss": 0.125}
        db.execute("UPDATE metrics SET data=? WHERE run_id=? AND kind='train' AND step=3",
                   (json.dumps(forged, sort_keys=True, separators=(",", ":")), finished_run))
        prov = json.loads(db.execute("SELECT data FROM provenance WHERE run_id=? AND segment=0",
                                     (finished_run,)).fetchone()["data"])
        prov["data"]["train"]["sha256"] = "0" * 64
        db.execute("UPDATE provenance SET data=? WHERE run_id=? AND segment=0",
                   (json.dumps(prov, sort_keys=True, separators=(",", ":")), finished_run))
    result = lodger(["audit"], lodger_home, ok=False)
    assert result.returncode == 1, describe(result)
    assert f"table metrics, run {finished_run}, step 3: the train row does not match" in result.stderr, describe(result)
    assert f"table provenance, run {finished_run}, segment 0, step 0: does not match" in result.stderr
    assert "ledger tables edited" in result.stderr
    blamed = [line for line in result.stderr.splitlines() if line.startswith("table ")]
    assert len(blamed) == 2, describe(result)  # nothing else is blamed
    # The readers that print or judge a run do not pass the forged rows off as the record.
    shown = lodger(["show", finished_run], lodger_home)
    assert f"WARNING   table metrics, run {finished_run}, step 3" in shown.stderr, describe(shown)
    judged = lodger(["compare", finished_run, finished_run], lodger_home, ok=False)
    assert "not trustworthy: the ledger's rows disagree with its hash chain" in judged.stdout + judged.stderr, \
        describe(judged)


def test_a_run_row_status_edited_in_the_table_is_named(lodger_home: Path, finished_run: str) -> None:
    with raw(lodger_home) as db:
        db.execute("UPDATE runs SET status='failed', loss=9.5 WHERE id=?", (finished_run,))
    result = lodger(["audit"], lodger_home, ok=False)
    assert f"table runs, run {finished_run}: column status is 'failed' but the chain says 'finished'" \
        in result.stderr, describe(result)
    assert f"table runs, run {finished_run}: column loss is 9.5" in result.stderr


# -- datasets and the gate -------------------------------------------------------------------
@pytest.fixture
def gated(tmp_path: Path, lodger_home: Path, tiny_model_dir: Path, chat_data: dict[str, Path]) -> dict:
    """Target `lab`; the train data registered and allowed to leave for it, the eval data may not leave."""
    storage = tmp_path / "storage"
    lodger(["target", "add", "lab", "--address", ADDRESS, "--storage", storage, *CAPS], lodger_home)
    lodger(["data", "add", chat_data["train"], "--name", "chat-train", "--license", "CC-BY-4.0", "--owner", "alice",
            "--leave", "--target", "lab"], lodger_home)
    lodger(["data", "add", chat_data["eval"], "--name", "chat-eval", "--license", "private", "--owner", "bob",
            "--target", "lab"], lodger_home)
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train="dataset:chat-train",
                    eval="dataset:chat-eval", steps=4, extra={"remote": dict(LIMITS)})
    return {"home": lodger_home, "job": job, "storage": storage}


def test_a_may_leave_flipped_in_the_table_is_named_by_audit_and_refused_by_the_gate(gated: dict) -> None:
    home = gated["home"]
    lodger(["audit"], home)
    with raw(home) as db:  # the forger lets the private eval data out without a grant
        db.execute("UPDATE datasets SET may_leave=1 WHERE name='chat-eval'")
    result = lodger(["audit"], home, ok=False)
    assert result.returncode == 1
    assert "table datasets, dataset 'chat-eval': column may_leave is 1 but the chain says 0" in result.stderr, \
        describe(result)

    result = lodger(["submit", gated["job"], "--target", "lab", "--approve"], home, ok=False)
    assert result.returncode == 4, describe(result)
    assert "disagrees with the ledger's hash chain" in result.stderr and "dataset 'chat-eval'" in result.stderr
    assert "nothing was submitted" in result.stderr
    assert kinds(home, "submit_approved") == [] and len(kinds(home, "submit_refused")) == 1
    assert not gated["storage"].exists() or not any(gated["storage"].iterdir())


def test_a_target_cap_raised_by_hand_is_refused_by_the_gate_and_named_by_audit(gated: dict) -> None:
    home = gated["home"]
    path = home / "targets.toml"
    path.write_text(path.read_text().replace("budget = 10.0", "budget = 1000000.0"))
    result = lodger(["submit", gated["job"], "--target", "lab", "--approve"], home, ok=False)
    assert result.returncode == 4, describe(result)
    assert "target 'lab' differs from what the ledger recorded (budget)" in result.stderr, describe(result)
    audit = lodger(["audit"], home, ok=False)
    assert "table targets, target 'lab': targets.toml differs from the chain in budget" in audit.stderr


# -- the queue -------------------------------------------------------------------------------
def test_the_agent_refuses_a_queued_job_whose_text_was_edited(tmp_path: Path, lodger_home: Path,
                                                              tiny_model_dir: Path, chat_data: dict[str, Path]) -> None:
    job = write_job(tmp_path / "queued.toml", model=tiny_model_dir, train=chat_data["train"], steps=2, name="q")
    assert lodger(["queue", "add", job], lodger_home).stdout.startswith("queued #1")
    with raw(lodger_home) as db:  # e.g. point the job at other data, or another model
        text = db.execute("SELECT job_toml FROM queue WHERE id=1").fetchone()["job_toml"]
        db.execute("UPDATE queue SET job_toml=? WHERE id=1", (text.replace("steps = 2", "steps = 2000"),))
    result = lodger(["agent", "--interval", "0.1", "--for-seconds", "2"], lodger_home)
    assert "refused queued job #1 (q)" in result.stderr and "edited in the ledger" in result.stderr, describe(result)
    [refused] = kinds(lodger_home, "queue_refused")
    assert refused["queue_id"] == 1 and "is not the text that was queued" in refused["reason"]
    assert kinds(lodger_home, "queue_starting") == []
    assert json.loads(lodger(["ls", "--json"], lodger_home).stdout) == []  # nothing ran
    assert "refused queued job #1" in (lodger_home / "queue" / "1.out").read_text()


def test_a_start_lost_with_its_agent_is_requeued_and_started_again_by_the_next_agent(
        tmp_path: Path, lodger_home: Path, tiny_model_dir: Path, chat_data: dict[str, Path]) -> None:
    from lodger.ledger import Ledger

    job = write_job(tmp_path / "queued.toml", model=tiny_model_dir, train=chat_data["train"], steps=2, name="q",
                    eval_every=None)
    lodger(["queue", "add", job], lodger_home)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with Ledger(lodger_home / "ledger.db") as ledger:  # an agent took it, then died before its run existed
        assert ledger.take_from_queue(1, "q-lost", agent_pid=gone.pid)
    try:
        lodger(["agent", "--interval", "0.2", "--for-seconds", "2"], lodger_home)
        [requeued] = kinds(lodger_home, "queue_requeued")
        assert requeued["lost_run_id"] == "q-lost" and f"pid {gone.pid}" in requeued["reason"]
        starts = kinds(lodger_home, "queue_starting")
        assert [s["run_id"] for s in starts][0] == "q-lost" and len(starts) == 2
        run_id = starts[1]["run_id"]

        def ended():  # the started job trains in its own process, after the agent has gone
            found = {r["id"]: r for r in json.loads(lodger(["ls", "--json"], lodger_home).stdout)}
            return found if found.get(run_id, {}).get("status") in ("finished", "failed") else None

        runs = wait_until(ended, 300, what=f"the requeued job's run {run_id} to end", interval=0.5)
    finally:
        reap(lodger_home)
    assert runs[run_id]["status"] == "finished" and list(runs) == [run_id]
    with raw(lodger_home) as db:
        assert tuple(db.execute("SELECT state, run_id FROM queue WHERE id=1").fetchone()) == ("started", run_id)
    lodger(["audit"], lodger_home)


def reap(home: Path) -> None:
    """Kill, by pid, any process still running with this test's LODGER_HOME (the queued job's run)."""
    marker = f"LODGER_HOME={home}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                continue


# -- witnesses -------------------------------------------------------------------------------
def test_a_rewritten_chain_passes_audit_but_not_a_witness_taken_before(tmp_path: Path, gated: dict) -> None:
    home, witness = gated["home"], tmp_path / "elsewhere" / "heads.jsonl"
    witness.parent.mkdir()
    out = lodger(["audit", "--witness", witness], home).stdout
    assert "witnessed head row" in out
    [line] = [json.loads(x) for x in witness.read_text().splitlines()]
    assert lodger(["audit", "--against", witness], home).returncode == 0

    # The forger grants chat-eval --leave in the past: edits the event and the table, then
    # recomputes every later hash and the chain head (tests/unit/forge.py does exactly that).
    with raw(home) as db:
        seq, data = next((r["seq"], json.loads(r["data"])) for r in db.execute(
            "SELECT seq, data FROM events WHERE kind='dataset_added' ORDER BY seq")
            if json.loads(r["data"])["name"] == "chat-eval")
        data["may_leave"] = True
        db.execute("UPDATE events SET data=? WHERE seq=?", (json.dumps(data, sort_keys=True, separators=(",", ":")),
                                                             seq))
        db.execute("UPDATE datasets SET may_leave=1 WHERE name='chat-eval'")
        rewrite_chain(db, from_seq=seq)
    assert lodger(["audit"], home).returncode == 0  # a same-account forger fools audit alone
    result = lodger(["audit", "--against", witness], home, ok=False)
    assert result.returncode == 1, describe(result)
    assert f"{witness} line 1: row {line['seq']} now has hash" in result.stderr
    assert "rewritten at or before" in result.stderr


def test_a_truncated_chain_is_caught_by_a_witness(tmp_path: Path, gated: dict) -> None:
    home, witness = gated["home"], tmp_path / "heads.jsonl"
    lodger(["audit", "--witness", witness], home)
    lodger(["data", "revoke", "chat-train", "--leave"], home)
    lodger(["audit", "--witness", witness], home)
    with raw(home) as db:  # cut the revocation off the end, head and table put back as before it
        last = db.execute("SELECT MAX(seq) FROM events").fetchone()[0]
        db.execute("DELETE FROM events WHERE seq=?", (last,))
        prev = db.execute("SELECT seq, hash FROM events WHERE seq=?", (last - 1,)).fetchone()
        db.execute("UPDATE chain_head SET seq=?, hash=?", (prev["seq"], prev["hash"]))
        db.execute("UPDATE datasets SET may_leave=1 WHERE name='chat-train'")
    assert lodger(["audit"], home).returncode == 0
    result = lodger(["audit", "--against", witness], home, ok=False)
    assert f"{witness} line 2: row {last} was witnessed" in result.stderr, describe(result)
    assert "truncated" in result.stderr and "line 1:" not in result.stderr


def test_witness_heads_signed_with_ed25519_verify_and_a_forged_line_does_not(tmp_path: Path, gated: dict) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    home, witness = gated["home"], tmp_path / "heads.jsonl"
    key = ed25519.Ed25519PrivateKey.generate()
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    (tmp_path / "key.pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    assert "(signed)" in lodger(["audit", "--witness", witness, "--sign-key", tmp_path / "key.pem"], home).stdout
    lodger(["audit", "--against", witness, "--public-key", tmp_path / "key.pub"], home)
    # A forger who rewrote the chain also rewrites the witness line to the new hash: the signature fails.
    line = json.loads(witness.read_text())
    line["hash"] = hashlib.sha256(b"forged").hexdigest()
    witness.write_text(json.dumps(line) + "\n")
    result = lodger(["audit", "--against", witness, "--public-key", tmp_path / "key.pub"], home, ok=False)
    assert "line 1: the signature does not match" in result.stderr, describe(result)


def test_an_approved_submission_carries_the_chain_head_it_left_with(tmp_path: Path, gated: dict) -> None:
    home = gated["home"]
    lodger(["data", "grant", "chat-eval", "--leave"], home)
    result = lodger(["submit", gated["job"], "--target", "lab", "--approve"], home, ok=False)
    assert "error:" in result.stderr, describe(result)  # nothing listens at the target: it fails after approval
    with raw(home) as db:
        approval = db.execute("SELECT seq, prev_hash, data FROM events WHERE kind='submit_approved'").fetchone()
    head = json.loads(approval["data"])["chain_head"]
    assert (head["seq"], head["hash"]) == (approval["seq"] - 1, approval["prev_hash"])
    # whoever holds the submission can have it checked against the owner's ledger later
    witness = tmp_path / "from-the-submission.jsonl"
    witness.write_text(json.dumps(head) + "\n")
    assert "all 1 witnessed head(s)" in lodger(["audit", "--against", witness], home).stdout


def test_a_zero_byte_ledger_is_not_taken_for_a_new_one_by_any_command(killed_run, lodger_home: Path,
                                                                      standard_job: Path, tmp_path: Path) -> None:
    """ledger.db emptied beside a run with checkpoints: ls, status, show, pause, logs, audit (with and
    without a witness), resume and run each exit 1 naming the run and the fix; nothing is written"""
    run_id, folder = killed_run
    witness = tmp_path / "heads.jsonl"
    lodger(["audit", "--witness", witness], lodger_home)
    ledger = lodger_home / "ledger.db"
    os.truncate(ledger, 0)  # what a failing disk, or someone covering their tracks, leaves
    before = sorted(p.name for p in (lodger_home / "runs").iterdir())
    for args in (["ls"], ["status"], ["show", run_id], ["pause", run_id], ["logs", run_id], ["audit"],
                 ["audit", "--against", witness], ["resume", run_id], ["run", standard_job]):
        result = lodger(args, lodger_home, ok=False)
        assert result.returncode == 1, describe(result)
        said = result.stderr
        assert f"error: {ledger}: the ledger does not know 1 run(s) whose folders in {lodger_home / 'runs'}" in said \
            and f": {run_id}." in said and "is 0 bytes" in said and "Put back ledger.db from a backup" in said, \
            describe(result)
        assert ledger.stat().st_size == 0, f"`lodger {args[0]}` wrote into the emptied ledger"
        assert sorted(p.name for p in (lodger_home / "runs").iterdir()) == before, f"`lodger {args[0]}` made a run"
