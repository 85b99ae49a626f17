"""Faults: SIGKILL in the middle of the commands that write something other than checkpoints.

Each command is killed at a named point of its write path (``LODGER_FAULT``: the process SIGKILLs
itself there), then the next command is run. What must hold: nothing half-written is ever taken as
complete, and the next command says what happened (or finds nothing to say, because nothing
happened):

- `lodger export`, killed with the export written but not yet renamed into place: DEST does not
  exist; the next export removes the leftover, says so, and succeeds;
- `lodger audit --witness`, killed before the new witness file replaces the old: the file holds its
  earlier lines whole; `--against` it still passes; the next `--witness` appends;
- `lodger data add` and `lodger queue add`, killed before their one ledger write: nothing is
  registered or queued, the ledger audits clean, the same command then works;
- `lodger sync` of a remote run, killed while copying its second checkpoint: only the first counts
  as committed here; the next sync copies the second and leaves nothing half-copied.
(A federated round's commit, killed: tests/unit/test_faults_federated.py.)
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from faults_helpers import assert_audit_clean
from helpers import describe, killed_by_sigkill, lodger_env, run_lodger, write_job

pytestmark = pytest.mark.faults


def _killed(args, home: Path, fault: str):
    result = run_lodger(args, lodger_env(home, LODGER_FAULT=fault))
    assert killed_by_sigkill(result.returncode), f"not killed at {fault}:\n{describe(result)}"
    return result


def test_export_killed_before_it_is_published_leaves_no_export_and_the_next_one_says_so(killed_run, lodger_home,
                                                                                          tmp_path):
    """DEST absent after the kill; the next export removes the leftover, names it, and succeeds"""
    run_id, _ = killed_run
    dest = tmp_path / "out" / "export"
    dest.parent.mkdir()
    _killed(["export", run_id, dest], lodger_home, "export_before_publish")
    assert not dest.exists(), "a killed export appeared at its destination"
    leftovers = sorted(p.name for p in dest.parent.glob(".export.tmp-*"))
    assert len(leftovers) == 1, leftovers
    again = run_lodger(["export", run_id, dest], lodger_env(lodger_home))
    assert again.returncode == 0, describe(again)
    assert f"removed {dest.parent / leftovers[0]}" in again.stdout and "never published" in again.stdout, \
        describe(again)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["export"]
    manifest = json.loads((dest / "MANIFEST.json").read_text())
    for name, meta in manifest["files"].items():
        assert hashlib.sha256((dest / name).read_bytes()).hexdigest() == meta["sha256"], name


def test_audit_killed_while_writing_a_witness_keeps_the_witness_file_whole(killed_run, lodger_home, tmp_path):
    """the witness file holds its earlier line; --against passes; the next --witness appends a second"""
    witness = tmp_path / "elsewhere" / "heads.jsonl"
    witness.parent.mkdir()
    env = lodger_env(lodger_home)
    assert run_lodger(["audit", "--witness", witness], env).returncode == 0
    before = witness.read_bytes()
    _killed(["audit", "--witness", witness], lodger_home, "atomic_before_rename")
    assert witness.read_bytes() == before
    assert [p.name for p in witness.parent.glob(".heads.jsonl.tmp-*")], "it was not killed writing the witness"
    against = run_lodger(["audit", "--against", witness], env)
    assert against.returncode == 0 and "all 1 witnessed head(s)" in against.stdout, describe(against)
    assert run_lodger(["audit", "--witness", witness], env).returncode == 0
    assert len(witness.read_text().splitlines()) == 2 and witness.read_bytes().startswith(before)


def test_data_add_killed_before_its_ledger_write_registers_nothing(lodger_home, chat_data):
    """`data ls` lists nothing, audit is clean, the same `data add` then registers it"""
    args = ["data", "add", chat_data["train"], "--name", "notes", "--license", "CC0-1.0", "--owner", "me"]
    _killed(args, lodger_home, "dataset_before_ledger")
    env = lodger_env(lodger_home)
    listed = run_lodger(["data", "ls", "--json"], env)
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], describe(listed)
    assert_audit_clean(lodger_home)
    again = run_lodger(args, env)
    assert again.returncode == 0, describe(again)
    assert [d["name"] for d in json.loads(run_lodger(["data", "ls", "--json"], env).stdout)] == ["notes"]
    assert_audit_clean(lodger_home)


def test_queue_add_killed_before_its_ledger_write_queues_nothing(lodger_home, tiny_model_dir, chat_data, tmp_path):
    """`queue ls` is empty, audit is clean, the same `queue add` then queues it as #1"""
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=chat_data["train"], steps=2)
    _killed(["queue", "add", job], lodger_home, "queue_before_ledger")
    env = lodger_env(lodger_home)
    listed = run_lodger(["queue", "ls", "--json"], env)
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], describe(listed)
    assert_audit_clean(lodger_home)
    again = run_lodger(["queue", "add", job], env)
    assert again.returncode == 0 and "queued #1" in again.stdout, describe(again)
    assert_audit_clean(lodger_home)


def _remote_run(home: Path, uri: str) -> str:
    """A local run recorded as submitted to storage ``uri`` (as lodger.remote.submit records it), with
    two committed checkpoints there (as the remote worker commits them)."""
    from lodger.ledger import Ledger
    from lodger.ledger.values import NewRun
    from lodger.remote import run_key
    from lodger.remote import storage
    from lodger.remote.storage import Storage

    run_id, job_text = "remote-run", b"name = 'remote'\n"
    store = Storage.open(uri).child(run_id)
    store.write_bytes("job.toml", job_text, exclusive=True)
    for step in (2, 4):
        files = {f"part-{i}.bin": bytes([step + i]) * (1000 + i) for i in range(3)}
        store.commit_folder(f"{run_key(run_id)}/checkpoints/step-{step:08d}", files,
                            storage.build_manifest(files, step=step, world_size=1))
    with Ledger(home / "ledger.db") as ledger:
        head = ledger.head()
        ledger.create_run(NewRun(run_id, name="remote", model="m", method="lora", job_hash="h", job_toml="",
                                 total_steps=10, pid=None, managed=True))
        info = {"kind": "ray", "address": "http://127.0.0.1:9", "storage": uri, "dir": store.uri,
                "python": sys.executable, "cost_per_gpu_hour": 0.0, "anchor": head["hash"],
                "job_sha256": hashlib.sha256(job_text).hexdigest()}
        ledger.update_run(run_id, target="t", remote=json.dumps(info), remote_job_id=f"{run_id}-s0")
    return run_id


def test_sync_killed_while_copying_a_checkpoint_takes_only_what_was_whole(lodger_home, tmp_path):
    """after the kill only step 2 is committed here; the next sync copies step 4, nothing half-copied stays"""
    from lodger.checkpoint import CheckpointStore

    run_id = _remote_run(lodger_home, f"file://{tmp_path}/store")
    _killed(["sync", run_id], lodger_home, "folder_before_rename@2")
    local = lodger_home / "runs" / run_id / "checkpoints"
    assert [step for step, _ in CheckpointStore(local, 2).committed()] == [2]
    assert [p.name for p in local.iterdir() if p.name.startswith(".tmp-00000004")], "the copy was not mid-way"
    again = run_lodger(["sync", run_id], lodger_env(lodger_home))
    assert again.returncode == 0, describe(again)
    assert "checkpoints here: step-00000002, step-00000004" in again.stdout, describe(again)
    assert sorted(p.name for p in local.iterdir()) == ["step-00000002", "step-00000004"]
    assert_audit_clean(lodger_home)
