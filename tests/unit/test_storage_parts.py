"""Storage and event-log pieces that must agree with the rest of lodger (no server needed)."""

from __future__ import annotations

import json

import pytest

from lodger import checkpoint, ledger
from lodger.errors import CheckpointError
from lodger.remote import eventlog, storage
from lodger.remote.storage import Storage, StorageError


def test_manifest_rules_are_the_checkpoint_stores():
    manifest = {"step": 3, "files": {"a": {"size": 1, "sha256": "x"}}, "world_size": 2}
    assert storage.MANIFEST == checkpoint.MANIFEST
    assert storage.manifest_hash(manifest) == checkpoint._manifest_hash(manifest)


def test_event_records_hash_like_ledger_events():
    data = {"b": [1, 2.5], "a": "é"}
    assert eventlog._canonical(data) == ledger._canonical(data)


def test_a_checkpoint_saved_by_the_store_is_listed_and_fetched_back_loadable(tmp_path):
    store = checkpoint.CheckpointStore(tmp_path / "remote" / "checkpoints")
    store.save(7, {"model.bin": b"\x01" * 100, "state.json": b"{}"})
    remote = Storage.open(str(tmp_path / "remote"))
    [found] = storage.list_checkpoints(remote, "checkpoints")
    assert found.step == 7
    (tmp_path / "home").mkdir()
    copied = storage.fetch(remote, found, tmp_path / "home")
    loaded = checkpoint.CheckpointStore(tmp_path / "home").load(copied)
    assert loaded.files == {"model.bin": b"\x01" * 100, "state.json": b"{}"}


def test_keys_that_climb_out_are_refused(tmp_path):
    remote = Storage.open(f"file://{tmp_path}")
    for key in ("../x", "a/../../x", "a\\b", "a/./b"):
        with pytest.raises(StorageError, match="not a plain name"):
            remote.write_bytes(key, b"x")
    assert list(tmp_path.parent.glob("x")) == []


def test_unknown_schemes_and_hosts_are_refused_with_the_fix():
    with pytest.raises(StorageError, match="s3://bucket/prefix"):
        Storage.open("gs://bucket/x")
    with pytest.raises(StorageError, match="file:///path"):
        Storage.open("file://otherhost/x")
    with pytest.raises(StorageError, match="no bucket"):
        Storage.open("s3:///x")


def test_commit_refuses_a_manifest_that_does_not_list_the_files(tmp_path):
    remote = Storage.open(str(tmp_path))
    files = {"a": b"123"}
    with pytest.raises(StorageError, match="build_manifest"):
        remote.commit_folder("step-00000001", files, {"files": {"a": {"size": 2}}})
    assert not (tmp_path / "step-00000001").exists()


def test_a_manifest_whose_step_differs_from_its_folder_is_not_a_checkpoint(tmp_path):
    remote = Storage.open(str(tmp_path))
    files = {"a": b"123"}
    remote.commit_folder("ck/step-00000002", files, storage.build_manifest(files, step=5))
    assert storage.list_checkpoints(remote, "ck") == []
    with pytest.raises(CheckpointError, match="says step 5"):
        storage.read_manifest(remote, "ck/step-00000002")
    json.loads(remote.read_bytes("ck/step-00000002/MANIFEST.json"))  # committed, only not valid


def test_a_symlinked_file_in_a_local_checkpoint_is_never_listed_or_read(tmp_path):
    remote = Storage.open(str(tmp_path / "store"))
    files = {"a.bin": b"1" * 10}
    remote.commit_folder("ck/step-00000001", files, storage.build_manifest(files, step=1))
    outside = tmp_path / "secret"
    outside.write_bytes(b"2" * 10)  # same size as the file it replaces
    target = tmp_path / "store" / "ck" / "step-00000001" / "a.bin"
    target.unlink()
    target.symlink_to(outside)
    assert storage.list_checkpoints(remote, "ck") == []
    with pytest.raises(StorageError, match="cannot read"):
        remote.read_bytes("ck/step-00000001/a.bin")
