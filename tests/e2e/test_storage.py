"""Storage by URI and the remote event log, on a local folder and on a real S3 server process.

Each test runs twice: on ``file://`` and on ``s3://`` served by ``moto_server`` on 127.0.0.1
(tests/e2e/s3_server.py), reached only through the AWS environment variables, as a user would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from s3_server import boto_client, s3_bucket, s3_server  # noqa: F401 - fixtures

from lodger.errors import CheckpointError
from lodger.remote import storage
from lodger.remote.eventlog import ChainError, EventLog, record_hash
from lodger.remote.storage import Storage, StorageError
from lodger.ledger.values import NewRun

ANCHOR = "ab" * 32  # stands for the local ledger's head hash recorded at submission


@pytest.fixture(params=["file", "s3"])
def uri(request, tmp_path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/store"
    return request.getfixturevalue("s3_bucket") + "/store"


def _files(n: int = 3) -> dict[str, bytes]:
    return {f"part-{i}.bin": bytes([i]) * (100 + i) for i in range(n)}


def _commit(remote: Storage, step: int, files=None, prefix="run/checkpoints") -> str:
    files = files or _files()
    key = f"{prefix}/step-{step:08d}"
    remote.commit_folder(key, files, storage.build_manifest(files, step=step, world_size=1))
    return key


def test_objects_write_read_list_size_delete(uri):
    remote = Storage.open(uri)
    assert remote.list("a") == [] and not remote.exists("a/b.txt")
    remote.write_bytes("a/b.txt", b"hello")
    remote.write_bytes("a/c/d.txt", b"x" * 10)
    assert remote.read_bytes("a/b.txt") == b"hello"
    assert remote.list("a") == ["b.txt", "c"]
    assert remote.entries("a") == {"b.txt": 5, "c": None}
    assert remote.size("a/c/d.txt") == 10 and remote.exists("a/c/d.txt")
    remote.write_bytes("a/b.txt", b"bye")  # a plain write replaces
    assert remote.read_bytes("a/b.txt") == b"bye"
    with pytest.raises(FileExistsError):
        remote.write_bytes("a/b.txt", b"other", exclusive=True)
    assert remote.read_bytes("a/b.txt") == b"bye"
    remote.delete("a/b.txt")
    assert not remote.exists("a/b.txt") and remote.list("a") == ["c"]
    with pytest.raises(FileNotFoundError):
        remote.read_bytes("a/b.txt")
    remote.delete("a", recursive=True)
    assert remote.list("a") == []


def test_a_committed_folder_is_listed_verified_and_fetched_bitwise(uri, tmp_path):
    remote = Storage.open(uri)
    _commit(remote, 4)
    _commit(remote, 8)
    with pytest.raises(StorageError, match="never rewritten"):
        _commit(remote, 8)
    found = storage.list_checkpoints(remote, "run/checkpoints")
    assert [c.step for c in found] == [8, 4]
    home = tmp_path / "home"
    home.mkdir()
    copied = storage.fetch(remote, found[0], home)
    assert {p.name: p.read_bytes() for p in copied.iterdir() if p.name != "MANIFEST.json"} == _files()
    assert (copied / "MANIFEST.json").read_bytes() == remote.read_bytes("run/checkpoints/step-00000008/MANIFEST.json")


def test_a_checkpoint_without_its_manifest_does_not_exist(uri, tmp_path):
    remote = Storage.open(uri)
    _commit(remote, 1)
    for name, data in _files().items():  # an upload that stopped before its manifest
        remote.write_bytes(f"run/checkpoints/step-00000002/{name}", data)
    assert [c.step for c in storage.list_checkpoints(remote, "run/checkpoints")] == [1]
    with pytest.raises(CheckpointError, match="no MANIFEST.json"):
        storage.read_manifest(remote, "run/checkpoints/step-00000002")


def test_a_truncated_or_altered_file_is_never_listed_or_fetched(uri, tmp_path):
    remote = Storage.open(uri)
    truncated, altered = _commit(remote, 1), _commit(remote, 2)
    remote.write_bytes(f"{truncated}/part-1.bin", _files()["part-1.bin"][:-1])
    assert [c.step for c in storage.list_checkpoints(remote, "run/checkpoints")] == [2]
    remote.write_bytes(f"{altered}/part-2.bin", b"\xff" * 102)  # same size: only hashing sees it
    [ckpt] = storage.list_checkpoints(remote, "run/checkpoints")
    home = tmp_path / "home"
    home.mkdir()
    with pytest.raises(CheckpointError, match="part-2.bin: size or sha256"):
        storage.fetch(remote, ckpt, home)
    assert list(home.iterdir()) == []


def test_a_manifest_naming_a_path_outside_is_never_listed_or_fetched(uri, tmp_path):
    remote = Storage.open(uri)
    manifest = storage.build_manifest({"../x": b"evil"}, step=3)
    remote.write_bytes("run/checkpoints/step-00000003/MANIFEST.json", json.dumps(manifest).encode())
    assert storage.list_checkpoints(remote, "run/checkpoints") == []
    with pytest.raises(CheckpointError, match="'../x', which is not a plain file name"):
        storage.read_manifest(remote, "run/checkpoints/step-00000003")
    assert not (tmp_path / "x").exists()


def test_an_upload_killed_before_its_manifest_leaves_no_checkpoint(uri, tmp_path):
    """A real process dies (SIGKILL) between the last file and the manifest."""
    code = ("import sys; from lodger.remote import storage; s = storage.Storage.open(sys.argv[1]); "
            "f = {'a.bin': b'1' * 50, 'b.bin': b'2' * 60}; "
            "s.commit_folder('run/checkpoints/step-00000005', f, storage.build_manifest(f, step=5))")
    env = {**os.environ, "LODGER_FAULT": "storage_before_manifest"}
    done = subprocess.run([sys.executable, "-c", code, uri], env=env, capture_output=True, timeout=120)
    remote = Storage.open(uri)
    if uri.startswith("s3://"):  # locally the folder appears by one rename, so the fault point is not reached
        assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
        assert remote.list("run/checkpoints/step-00000005") == ["a.bin", "b.bin"]
    else:
        assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert [c.step for c in storage.list_checkpoints(remote, "run/checkpoints")] == ([] if uri.startswith("s3")
                                                                                    else [5])


def _log(uri: str) -> EventLog:
    return EventLog(Storage.open(uri), "run/events", run_id="r1", anchor=ANCHOR)


def test_the_event_log_reads_what_is_new_and_continues_the_anchor(uri):
    log = _log(uri)
    first = [log.append("started", {"step": 0}), log.append("metrics", {"loss": 1.5, "step": 1})]
    reader = _log(uri)  # a reader in another process knows only the anchor
    got = reader.read_new(0, ANCHOR)
    assert got == first and got[0]["prev_hash"] == ANCHOR and got[1]["prev_hash"] == got[0]["hash"]
    third = log.append("checkpoint", {"step": 2})
    assert reader.read_new(2, got[1]["hash"]) == [third]
    assert reader.read_new(3, third["hash"]) == []
    assert reader.head() == (3, third["hash"])
    assert Storage.open(uri).list("run/events") == ["000000001.json", "000000002.json", "000000003.json"]


def test_a_second_writer_cannot_fork_the_log(uri):
    one, two = _log(uri), _log(uri)
    one.append("a", {})
    two.head()
    one.append("b", {})
    with pytest.raises(ChainError, match="record 2 already exists"):
        two.append("c", {})  # its head is stale; the create-only write refuses to overwrite record 2
    assert [r["kind"] for r in _log(uri).read_new(0, ANCHOR)] == ["a", "b"]


def test_a_gap_in_the_log_is_refused_naming_the_record(uri):
    log = _log(uri)
    for i in range(3):
        log.append("step", {"i": i})
    log.storage.delete("run/events/000000002.json")
    with pytest.raises(ChainError, match="record 2 is missing but 3 exists"):
        _log(uri).read_new(0, ANCHOR)


def test_an_edited_record_is_refused_naming_it(uri):
    log = _log(uri)
    records = [log.append("step", {"loss": 2.0 - i}) for i in range(3)]
    edited = dict(records[1], data={"loss": 0.001})  # keeps its old hash
    log.storage.write_bytes("run/events/000000002.json", json.dumps(edited).encode())
    with pytest.raises(ChainError, match="record 2's hash does not match its content"):
        _log(uri).read_new(1, records[0]["hash"])


def test_a_rewritten_history_is_refused_as_a_fork(uri):
    log = _log(uri)
    seen = [log.append("step", {"i": i}) for i in range(2)]
    # Someone rewrites the log from record 2 on with a fully consistent chain of their own.
    log.storage.delete("run/events/000000002.json")
    forger = _log(uri)
    forger.append("step", {"i": 99})
    with pytest.raises(ChainError, match="record 2 is not the one taken here"):
        _log(uri).read_new(2, seen[1]["hash"])  # the reader already holds the real record 2
    with pytest.raises(ChainError, match="record 1 does not continue"):
        EventLog(Storage.open(uri), "run/events", anchor="cd" * 32).read_new(0, "cd" * 32)


def test_a_record_branching_off_an_earlier_one_is_refused_as_a_fork(uri):
    log = _log(uri)
    records = [log.append("step", {"i": i}) for i in range(3)]
    branch = {**records[2], "data": {"i": 7}, "prev_hash": records[0]["hash"]}  # continues record 1, not 2
    branch["hash"] = record_hash(branch)
    log.storage.delete("run/events/000000003.json")
    log.storage.write_bytes("run/events/000000003.json", json.dumps(branch).encode())
    with pytest.raises(ChainError, match="record 3 does not continue the chain recorded here"):
        _log(uri).read_new(1, records[0]["hash"])


def test_s3_credentials_come_from_a_named_profile_and_are_never_stored(s3_bucket, s3_server, tmp_path,
                                                                         monkeypatch):
    secret = "lodger-test-secret-do-not-store"
    creds = tmp_path / "credentials"
    creds.write_text(f"[lodgertest]\naws_access_key_id = AKIDLODGER\naws_secret_access_key = {secret}\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    remote = Storage.open(f"{s3_bucket}/store", profile="lodgertest")
    _commit(remote, 1)
    EventLog(remote, "run/events", anchor=ANCHOR).append("started", {"uri": remote.uri})
    assert [c.step for c in storage.list_checkpoints(remote, "run/checkpoints")] == [1]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    client = boto_client(s3_server)
    bucket = s3_bucket.removeprefix("s3://")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert keys and all(b"AKIDLODGER" not in client.get_object(Bucket=bucket, Key=k)["Body"].read()
                        and secret.encode() not in client.get_object(Bucket=bucket, Key=k)["Body"].read()
                        for k in keys)
    assert secret not in repr(remote) and secret not in remote.uri


def test_files_stream_up_and_down_unchanged(uri, tmp_path):
    remote = Storage.open(uri)
    source = tmp_path / "model.safetensors"
    source.write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    remote.put_file(source, "run/model/model.safetensors")
    assert remote.size("run/model/model.safetensors") == source.stat().st_size
    back = tmp_path / "back.safetensors"
    remote.get_file("run/model/model.safetensors", back)
    assert back.read_bytes() == source.read_bytes()
    with pytest.raises(FileNotFoundError):
        remote.get_file("run/model/absent", tmp_path / "absent")
    assert not (tmp_path / "absent").exists()


# -- wired into remote runs: sync and resume take only what verifies; heartbeats count killed time --

def _remote_run(bucket: str, home: Path, monkeypatch, job_text: bytes = b"name = 'x'\n") -> tuple[dict, Storage]:
    """A local run recorded as submitted to ``bucket`` (what lodger.remote.submit records)."""
    import hashlib

    from lodger.ledger import Ledger

    monkeypatch.setenv("LODGER_HOME", str(home))
    run_id = "wired-run"
    run_store = Storage.open(f"{bucket}/store").child(run_id)
    run_store.write_bytes("job.toml", job_text, exclusive=True)
    with Ledger() as ledger:
        head = ledger.head()
        ledger.create_run(NewRun(run_id, name="wired", model="m", method="lora", job_hash="h", job_toml="",
                          total_steps=10, pid=None, managed=True))
        info = {"kind": "ray", "address": "http://127.0.0.1:1", "storage": f"{bucket}/store", "dir": run_store.uri,
                "python": sys.executable, "cost_per_gpu_hour": 0.0, "anchor": head["hash"],
                "job_sha256": hashlib.sha256(job_text).hexdigest()}
        ledger.update_run(run_id, target="t", remote=json.dumps(info), remote_job_id=f"{run_id}-s0")
        return ledger.run(run_id), run_store


def test_sync_and_resume_take_only_checkpoints_whose_manifest_verifies(s3_bucket, tmp_path, monkeypatch):
    from lodger.home import run_dir
    from lodger.ledger import Ledger
    from lodger.remote import RemoteError, run_key
    from lodger.remote.mirror import seed
    from lodger.remote.sync import sync

    run, store = _remote_run(s3_bucket, tmp_path / "home", monkeypatch)
    prefix = f"{run_key(run['id'])}/checkpoints"
    _commit(store, 2, prefix=prefix)
    for name, data in _files().items():  # step 4: uploaded, never committed (no manifest)
        store.write_bytes(f"{prefix}/step-00000004/{name}", data)
    truncated = _commit(store, 6, prefix=prefix)  # step 6: committed, then a file cut short
    store.write_bytes(f"{truncated}/part-0.bin", _files()["part-0.bin"][:-3])
    altered = _commit(store, 8, prefix=prefix)  # step 8: same size, other bytes (only hashing sees it)
    store.write_bytes(f"{altered}/part-2.bin", b"\x00" * 102)
    log = EventLog(store, "events", run_id=run["id"], anchor=json.loads(run["remote"])["anchor"])
    log.append("batch", {"run": {"step": 8, "loss": 1.0, "segment": 0, "status": "running", "total_steps": 10},
                         "metrics": [{"kind": "train", "step": 1, "loss": 2.0, "segment": 0}],
                         "events": [{"seq": 1, "time": 1.0, "kind": "started", "data": {}}]})
    with Ledger() as ledger:
        synced = sync(ledger, run)
        assert sorted(p.name for p in (run_dir(run["id"]) / "checkpoints").iterdir()) == ["step-00000002"]
        assert synced["status"] == "running" and synced["step"] == 8 and synced["remote_seq"] == 1
        assert synced["remote_log_hash"] == log.head()[1]
        assert [e["data"]["remote_kind"] for e in ledger.events(run["id"]) if e["kind"] == "remote_event"] \
            == ["started"]
        assert ledger.metrics(run["id"])[0]["loss"] == 2.0
        again = sync(ledger, synced)  # nothing new: nothing taken twice
        assert again["remote_seq"] == 1 and len(ledger.metrics(run["id"])) == 1
        # A record rewritten behind this machine's back is refused, naming it; nothing is taken.
        forged = {**json.loads(store.read_bytes("events/000000001.json")), "data": {"run": {"step": 99}}}
        forged["hash"] = record_hash(forged)
        store.write_bytes("events/000000001.json", json.dumps(forged).encode())
        with pytest.raises(RemoteError, match="record 1 is not the one taken here"):
            sync(ledger, again)
        assert ledger.run(run["id"])["step"] == 8
    fresh = tmp_path / "node" / "run"  # a fresh node resuming: only step 2 verifies
    fresh.mkdir(parents=True)
    assert seed(store, run["id"], fresh) == 2
    assert sorted(p.name for p in (fresh / "checkpoints").iterdir()) == ["step-00000002"]


def test_sync_of_a_run_whose_storage_cannot_be_reached_says_so_and_takes_nothing(s3_bucket, tmp_path, monkeypatch):
    import socket

    from lodger.home import run_dir
    from lodger.ledger import Ledger
    from lodger.remote import RemoteError
    from lodger.remote.sync import sync

    run, _ = _remote_run(s3_bucket, tmp_path / "home", monkeypatch)
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{sock.getsockname()[1]}")
    with Ledger() as ledger, pytest.raises(RemoteError, match="cannot read the job run wired-run was submitted with"):
        sync(ledger, run)
    assert not run_dir(run["id"]).exists()


def test_a_job_killed_repeatedly_without_checkpoints_stops_at_its_wall_time_limit(s3_bucket, tmp_path, monkeypatch,
                                                                                  tiny_model_dir, e2e_data):
    """Two submissions killed without a checkpoint left only their heartbeats: the next training
    process starts with their wall time counted and stops at once; `lodger resume` refuses to submit."""
    import time
    from types import SimpleNamespace

    from helpers import write_job

    from lodger.owner.control import Control, read_requests
    from lodger.lifecycle.jobfile import load_job
    from lodger.remote import heartbeat
    from lodger.remote.backend import RemoteError
    from lodger.train.limits import REMOTE_ENV, LimitWatch

    store = Storage.open(f"{s3_bucket}/store").child("killed-run")
    heartbeat.write(store, "killed-run-s0", 40.0, segment=0)  # SIGKILLed: its last heartbeat stays
    heartbeat.write(store, "killed-run-s1", 35.0, segment=1)
    store.write_bytes("heartbeats/not-a-heartbeat.json", b"{")  # what does not parse is left out
    assert heartbeat.spent_wall_seconds(store) == 75.0
    assert heartbeat.spent_wall_seconds(store, exclude="killed-run-s1") == 40.0
    job = load_job(write_job(tmp_path / "job.toml", model=tiny_model_dir, train=e2e_data["train"],
                             extra={"remote": {"wall_hours": 60 / 3600}}))  # one minute
    with pytest.raises(RemoteError, match="already spent 0.0208 h of its \\[remote\\] wall_hours"):
        heartbeat.refuse_past_wall_limit(store, "killed-run", job.remote.wall_hours)
    heartbeat.refuse_past_wall_limit(store, "killed-run", 1.0)  # under a larger limit it may go on

    folder = tmp_path / "run"
    folder.mkdir()
    monkeypatch.setenv(REMOTE_ENV, "1")
    monkeypatch.setenv(heartbeat.PRIOR_ENV, repr(heartbeat.spent_wall_seconds(store)))  # what the worker passes
    meter = SimpleNamespace(wall0=time.time(), cpu0=time.process_time())
    watch = LimitWatch(job, "cpu", folder, Control(folder), meter)
    assert watch.prior_wall_seconds == 0.0  # the ledger of a fresh node knows no earlier segment
    watch.check()
    limit = read_requests(folder)["limit"]
    assert limit["state"] == "release" and "wall-time limit" in limit["reason"] and limit["wall_hours"] >= 75 / 3600
