"""A full file system, met by the pieces that write: a tmpfs of 1 MiB (tests/fault_fs.py), really
full (ENOSPC), not a mock. Each write fails as a DiskFull naming the path, what it needed and what
is free, and leaves nothing half-written behind; the ledger rolls a transaction back whole."""

from __future__ import annotations

import pytest

from fault_fs import fill, free, small_disk
from lodger import durable
from lodger.checkpoint import CheckpointStore
from lodger.errors import DiskFull
from lodger.ledger import Ledger

pytestmark = pytest.mark.faults


@pytest.fixture
def disk(tmp_path):
    with small_disk(tmp_path / "disk", "1m") as where:
        yield where


def test_a_file_that_does_not_fit_is_removed_and_the_error_names_it_with_its_size(disk):
    """durable.write_file on a full tmpfs: DiskFull naming the file, its size and the free space; no partial file"""
    fill(disk)
    free_now = durable.free_bytes(disk)
    with pytest.raises(DiskFull) as caught:
        durable.write_file(disk / "big.bin", b"x" * 300_000)
    assert not (disk / "big.bin").exists()
    text = str(caught.value)
    assert f"{disk / 'big.bin'}" in text and "it needs 293.0 KiB" in text and "free there" in text, text
    assert caught.value.free is not None and caught.value.free <= free_now + 4096


def test_an_atomic_replace_that_does_not_fit_keeps_the_old_content(disk):
    """durable.atomic_write: the old content stays, no hidden sibling, the error names the file"""
    durable.atomic_write(disk / "state.json", b"old")
    fill(disk)
    with pytest.raises(DiskFull) as caught:
        durable.atomic_write(disk / "state.json", b"n" * 100_000)
    assert (disk / "state.json").read_bytes() == b"old"
    assert sorted(p.name for p in disk.iterdir()) == ["filler.bin", "state.json"]
    assert str(disk / "state.json") in str(caught.value)


def test_a_folder_that_does_not_fit_never_appears_and_leaves_no_hidden_sibling(disk):
    """durable.write_folder: the folder never appears, its hidden sibling is removed, the need is named"""
    fill(disk)
    with pytest.raises(DiskFull) as caught:
        durable.write_folder(disk / "out", {"a": b"1" * 50_000, "b": b"2" * 50_000})
    assert sorted(p.name for p in disk.iterdir()) == ["filler.bin"]
    assert "it needs 97.7 KiB" in str(caught.value)


def test_a_checkpoint_that_does_not_fit_leaves_the_committed_ones_and_its_space(disk):
    """CheckpointStore.save: committed checkpoints untouched, the half-written one removed; saves once freed"""
    store = CheckpointStore(disk / "checkpoints", keep_last=2)
    store.save(1, {"state.json": b"{}"})
    fill(disk)
    with pytest.raises(DiskFull) as caught:
        store.save(2, {"weights.bin": b"w" * 200_000, "state.json": b"{}"})
    assert [p.name for p in (disk / "checkpoints").iterdir()] == ["step-00000001"]
    assert store.load_step(1).step == 1
    text = str(caught.value)
    assert "checkpoints/step-00000002 (checkpoint step 2)" in text and "it needs 199.3 KiB" in text, text
    free(disk)
    assert store.save(2, {"weights.bin": b"w" * 200_000, "state.json": b"{}"}).name == "step-00000002"


def test_a_ledger_write_on_a_full_disk_is_rolled_back_whole_and_names_ledger_db(disk):
    """a ledger transaction on a full disk: DiskFull naming ledger.db, the chain intact, writes go on once freed"""
    path = disk / "ledger.db"
    with Ledger(path) as ledger:
        ledger.event(None, "warning", text="before")
        head = ledger.head()
        fill(disk)
        with pytest.raises(DiskFull) as caught:
            for n in range(2000):  # until the write-ahead log needs a page the disk does not have
                ledger.event(None, "warning", text="x" * 2000, n=n)
        assert str(path) in str(caught.value) and "(the ledger" in str(caught.value)
        free(disk)
        count, problems = ledger.audit()
        assert problems == [] and count >= 1
        assert ledger.head()["seq"] >= head["seq"]
        ledger.event(None, "warning", text="after")  # the same connection goes on once there is room
        assert ledger.audit()[1] == []
