"""A job's model may be a hub id: it resolves to a snapshot already in the local Hugging Face cache
(laid out as huggingface_hub lays it out), by id and revision, and never touches the network."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
from pathlib import Path

import pytest

from lodger.errors import ModelSourceError
from lodger.model import resolve_source

COMMIT_MAIN = "a" * 40
COMMIT_V1 = "b" * 40


def make_hub_cache(root: Path, repo_id: str, model_dir: Path, refs: dict[str, str]) -> Path:
    """models--org--name/{blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>, refs/<rev>}."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for rev, commit in refs.items():
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        for file in model_dir.iterdir():
            blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
            if not blob.exists():
                shutil.copyfile(file, blob)
            link = snapshot / file.name
            if not link.exists():
                os.symlink(os.path.relpath(blob, snapshot), link)
        (repo / "refs" / rev).write_text(commit)
    return repo


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def hub_cache(tmp_path, tiny_model_dir, monkeypatch) -> Path:
    cache = tmp_path / "hf" / "hub"
    make_hub_cache(cache, "tiny-org/tiny-llama", tiny_model_dir, {"main": COMMIT_MAIN, "v1": COMMIT_V1})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_hub_id_resolves_to_the_main_snapshot_and_records_its_commit(hub_cache, no_network):
    source = resolve_source("tiny-org/tiny-llama")
    assert source.kind == "hf"
    assert source.path == (hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT_MAIN).resolve()
    assert source.hub == {"id": "tiny-org/tiny-llama", "revision": "main", "commit": COMMIT_MAIN}
    assert source.provenance()["hub"]["commit"] == COMMIT_MAIN


def test_hub_id_resolves_by_revision_name_and_by_commit(hub_cache, no_network):
    by_tag = resolve_source("tiny-org/tiny-llama@v1")
    assert by_tag.hub["commit"] == COMMIT_V1 and by_tag.path.name == COMMIT_V1
    by_arg = resolve_source("tiny-org/tiny-llama", revision="v1")
    assert by_arg.path == by_tag.path
    by_commit = resolve_source(f"tiny-org/tiny-llama@{COMMIT_MAIN}")
    assert by_commit.hub["commit"] == COMMIT_MAIN
    # same files, same identity, whichever snapshot they came from
    assert by_commit.sha256 == by_tag.sha256


def test_hf_home_is_honoured_when_hf_hub_cache_is_not_set(tmp_path, tiny_model_dir, monkeypatch, no_network):
    make_hub_cache(tmp_path / "home-hf" / "hub", "tiny-org/tiny-llama", tiny_model_dir, {"main": COMMIT_MAIN})
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home-hf"))
    assert resolve_source("tiny-org/tiny-llama").path.name == COMMIT_MAIN


def test_missing_hub_id_is_a_clear_error_without_network(hub_cache, no_network):
    with pytest.raises(ModelSourceError) as info:
        resolve_source("tiny-org/not-here")
    message = str(info.value)
    assert "not in the local Hugging Face cache" in message and str(hub_cache) in message
    assert "huggingface-cli download tiny-org/not-here" in message
    with pytest.raises(ModelSourceError, match="revision 'v9'"):
        resolve_source("tiny-org/tiny-llama@v9")


def test_conflicting_revisions_are_refused(hub_cache):
    with pytest.raises(ModelSourceError, match="keep one of them"):
        resolve_source("tiny-org/tiny-llama@v1", revision="main")
