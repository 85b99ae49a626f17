"""CheckpointStore: atomic save, verified load, fallback past damage, stale clean-up, pruning."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lodger import __version__, durable
from lodger.checkpoint import FAULT_POINTS, MANIFEST, CheckpointStore
from lodger.errors import CheckpointError


def payload(step: int) -> dict[str, bytes]:
    """Small, step-specific files shaped like a real checkpoint (one tensor file, some JSON)."""
    return {
        "adapter_model.safetensors": bytes((step * 7 + i) % 256 for i in range(300 + step)),
        "optimizer.json": json.dumps({"step": step, "lr": 1e-3 * step}).encode(),
        "state.json": json.dumps({"progress": {"step": step, "position": 4 * step}}).encode(),
    }


def step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


class OpLog:
    """Records every durable operation in order (a real recorder, installed through durable.set_recorder)."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, str, str | None]] = []

    def record(self, op: str, path: Path, dest: Path | None = None) -> None:
        self.ops.append((op, path.name, None if dest is None else dest.name))


@pytest.fixture
def oplog():
    log = OpLog()
    durable.set_recorder(log)
    yield log
    durable.set_recorder(None)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "run" / "checkpoints"
    path.mkdir(parents=True)  # exists already, so the recorded operations start with the save itself
    return path


# -- save and load ---------------------------------------------------------------------------


def test_saved_checkpoint_loads_back_with_identical_files_and_info(root: Path) -> None:
    store = CheckpointStore(root, keep_last=3, world_size=2)
    path = store.save(12, payload(12), info={"tokens_seen": 4096})
    assert path == root / "step-00000012"
    ckpt = store.load(path)
    assert ckpt.step == 12
    assert ckpt.path == path
    assert ckpt.files == payload(12)
    assert ckpt.manifest["tokens_seen"] == 4096
    assert ckpt.manifest["world_size"] == 2
    assert ckpt.manifest["lodger_version"] == __version__
    assert ckpt.manifest["step"] == 12


def test_manifest_lists_every_file_with_its_size_and_sha256(root: Path) -> None:
    store = CheckpointStore(root, keep_last=2)
    path = store.save(3, payload(3))
    manifest = json.loads((path / MANIFEST).read_bytes())
    assert set(manifest["files"]) == set(payload(3))
    for name, data in payload(3).items():
        assert manifest["files"][name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        assert (path / name).read_bytes() == data
    assert sorted(p.name for p in path.iterdir()) == sorted([*payload(3), MANIFEST])


def test_save_leaves_no_temporary_folder_behind(root: Path) -> None:
    store = CheckpointStore(root, keep_last=2)
    store.save(1, payload(1))
    store.save(2, payload(2))
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002"]


def test_manifest_is_written_last_and_the_folder_is_fsynced_before_the_rename(root: Path, oplog: OpLog) -> None:
    store = CheckpointStore(root, keep_last=2)
    store.save(4, payload(4))
    ops = oplog.ops
    tmp = ops[0][1]
    assert ops[0][0] == "mkdir" and tmp.startswith(".tmp-00000004-")
    fsynced = [name for op, name, _ in ops if op == "fsync"]
    assert fsynced == [*payload(4), MANIFEST]
    assert ops[-3:] == [("fsync_dir", tmp, None), ("rename", tmp, "step-00000004"), ("fsync_dir", "checkpoints", None)]


def test_saving_the_same_step_twice_keeps_only_the_newer_files(root: Path) -> None:
    store = CheckpointStore(root, keep_last=2)
    store.save(1, payload(1))
    store.save(3, payload(3))
    newer = {**payload(3), "state.json": b'{"again": true}'}
    path = store.save(3, newer)
    assert step_dirs(root) == ["step-00000001", "step-00000003"]
    assert store.load(path).files == newer
    assert not [p for p in root.iterdir() if p.name.startswith((".tmp-", ".trash-"))]
    assert store.latest_good().files == newer


def test_keep_last_below_two_is_refused(root: Path) -> None:
    for bad in (1, 0, -3):
        with pytest.raises(ValueError, match="keep_last"):
            CheckpointStore(root, keep_last=bad)
    CheckpointStore(root, keep_last=2)


# -- damage is detected, moved aside, and the previous good checkpoint is used ----------------


def _truncate(path: Path) -> str:
    target = path / "adapter_model.safetensors"
    target.write_bytes(target.read_bytes()[:-17])
    return "adapter_model.safetensors"


def _flip_byte(path: Path) -> str:
    target = path / "adapter_model.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    return "sha256"


def _remove_manifest(path: Path) -> str:
    (path / MANIFEST).unlink()
    return MANIFEST


def _remove_file(path: Path) -> str:
    (path / "state.json").unlink()
    return "state.json"


def _garble_manifest(path: Path) -> str:
    manifest = path / MANIFEST
    manifest.write_bytes(manifest.read_bytes()[:40])
    return MANIFEST


def _manifest_without_files(path: Path) -> str:
    (path / MANIFEST).write_text(json.dumps({"step": 2, "format": 1}))
    return "file list"


DAMAGE = {
    "truncated file": _truncate,
    "flipped byte": _flip_byte,
    "missing manifest": _remove_manifest,
    "missing file": _remove_file,
    "cut-off manifest": _garble_manifest,
    "manifest without a file list": _manifest_without_files,
}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_load_reports_damage_naming_what_is_wrong(root: Path, damage) -> None:
    store = CheckpointStore(root, keep_last=3)
    path = store.save(2, payload(2))
    clue = damage(path)
    with pytest.raises(CheckpointError) as info:
        store.load(path)
    assert "step-00000002" in str(info.value)
    assert clue in str(info.value)


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_damaged_checkpoint_is_moved_aside_reported_and_the_previous_good_one_returned(root: Path, damage) -> None:
    store = CheckpointStore(root, keep_last=3)
    store.save(1, payload(1))
    newest = store.save(2, payload(2))
    damage(newest)
    snapshot = {p.name: p.read_bytes() for p in newest.iterdir()}
    reports = []

    ckpt = CheckpointStore(root, keep_last=3).latest_good(
        on_damaged=lambda path, reason, aside: reports.append((path, reason, aside)))

    assert ckpt is not None and ckpt.step == 1
    assert ckpt.files == payload(1)
    assert step_dirs(root) == ["step-00000001"]
    damaged = [p for p in root.iterdir() if p.name.startswith("damaged-")]
    assert len(damaged) == 1 and damaged[0].name.startswith("damaged-step-00000002-")
    assert {p.name: p.read_bytes() for p in damaged[0].iterdir()} == snapshot  # moved, not deleted
    assert len(reports) == 1
    path, reason, aside = reports[0]
    assert path == newest and aside == damaged[0]
    assert "step-00000002" in reason


def test_every_damaged_checkpoint_is_moved_aside_and_none_returned_when_none_is_good(root: Path) -> None:
    store = CheckpointStore(root, keep_last=3)
    for step, damage in ((1, _truncate), (2, _remove_manifest), (3, _flip_byte)):
        damage(store.save(step, payload(step)))
    reports = []
    assert store.latest_good(on_damaged=lambda *args: reports.append(args)) is None
    assert [r[0].name for r in reports] == ["step-00000003", "step-00000002", "step-00000001"]
    assert step_dirs(root) == []
    assert len([p for p in root.iterdir() if p.name.startswith("damaged-")]) == 3


def test_latest_good_without_a_callback_still_moves_damage_aside(root: Path) -> None:
    store = CheckpointStore(root, keep_last=3)
    store.save(1, payload(1))
    _flip_byte(store.save(2, payload(2)))
    assert store.latest_good().step == 1
    assert step_dirs(root) == ["step-00000001"]


def test_a_half_written_folder_is_never_returned_even_with_a_complete_manifest(root: Path) -> None:
    store = CheckpointStore(root, keep_last=3)
    store.save(1, payload(1))
    staged = store.save(9, payload(9))
    staged.rename(root / ".tmp-00000009-abcd1234")  # as if the process died just before the rename
    assert store.latest_good().step == 1


def test_save_after_a_damaged_step_was_moved_aside_writes_that_step_again(root: Path) -> None:
    store = CheckpointStore(root, keep_last=3)
    store.save(1, payload(1))
    _truncate(store.save(2, payload(2)))
    assert store.latest_good().step == 1
    store.save(2, payload(2))
    assert store.latest_good().files == payload(2)


def test_a_step_damaged_twice_is_moved_aside_twice_without_crashing(root: Path) -> None:
    store = CheckpointStore(root, keep_last=3)
    store.save(1, payload(1))
    now = int(time.time())
    for second in range(now - 1, now + 60):  # an earlier damaged copy of step 2, moved aside "this second"
        earlier = root / f"damaged-step-00000002-{second}"
        earlier.mkdir()
        (earlier / "state.json").write_bytes(b"earlier copy")
    _flip_byte(store.save(2, payload(2)))
    assert store.latest_good().step == 1
    assert step_dirs(root) == ["step-00000001"]
    assert len([p for p in root.iterdir() if p.name.startswith("damaged-step-00000002-")]) == 62


def test_a_manifest_without_a_step_is_damage_not_a_crash(root: Path) -> None:
    store = CheckpointStore(root, keep_last=3)
    store.save(1, payload(1))
    path = store.save(2, payload(2))
    manifest = path / MANIFEST
    manifest.write_bytes(manifest.read_bytes().replace(b'"step"', b'"stdp"'))
    with pytest.raises(CheckpointError):
        store.load(path)
    assert store.latest_good().step == 1


def test_a_manifest_whose_step_disagrees_with_its_folder_is_rejected(root: Path) -> None:
    store = CheckpointStore(root, keep_last=3)
    store.save(1, payload(1))
    path = store.save(5, payload(5))
    manifest = path / MANIFEST
    manifest.write_bytes(manifest.read_bytes().replace(b'"step": 5', b'"step": 4'))
    with pytest.raises(CheckpointError):
        store.load(path)
    assert store.latest_good().step == 1


def test_any_single_flipped_bit_in_the_manifest_is_detected_or_harmless(root: Path) -> None:
    store = CheckpointStore(root, keep_last=3)
    path = store.save(5, payload(5))
    original = (path / MANIFEST).read_bytes()
    escaped = []
    fd = os.open(path / MANIFEST, os.O_RDWR)  # flip in place: reopening the file a thousand times is slow
    try:
        for index, byte in enumerate(original):
            os.pwrite(fd, bytes([byte ^ 0x01]), index)
            try:
                ckpt = store.load(path)
            except CheckpointError:
                continue
            except Exception as exc:  # noqa: BLE001 - anything else escapes latest_good
                escaped.append((index, repr(exc)))
                continue
            finally:
                os.pwrite(fd, bytes([byte]), index)
            if ckpt.step != 5 or ckpt.files != payload(5):
                escaped.append((index, f"loaded as step {ckpt.step}"))
    finally:
        os.close(fd)
    assert escaped == []


# -- clean-up and pruning -------------------------------------------------------------------


def test_clean_stale_removes_half_written_and_half_deleted_folders_only(root: Path) -> None:
    store = CheckpointStore(root, keep_last=3)
    store.save(1, payload(1))
    for name in (".tmp-00000002-0a0b0c0d", ".trash-step-00000000-01020304"):
        (root / name).mkdir()
        (root / name / "adapter_model.safetensors").write_bytes(b"partial")
    (root / "damaged-step-00000007-1700000000").mkdir()

    removed = store.clean_stale()

    assert sorted(p.name for p in removed) == [".tmp-00000002-0a0b0c0d", ".trash-step-00000000-01020304"]
    assert sorted(p.name for p in root.iterdir()) == ["damaged-step-00000007-1700000000", "step-00000001"]
    assert store.latest_good().files == payload(1)
    assert store.clean_stale() == []


def test_prune_keeps_the_newest_keep_last_checkpoints(root: Path) -> None:
    store = CheckpointStore(root, keep_last=3)
    for step in (10, 20, 30, 40, 50):
        store.save(step, payload(step))
    assert step_dirs(root) == ["step-00000030", "step-00000040", "step-00000050"]
    assert sorted(p.name for p in root.iterdir()) == step_dirs(root)
    for step in (30, 40, 50):
        assert store.load(root / f"step-{step:08d}").files == payload(step)


def test_prune_deletes_old_checkpoints_only_after_the_new_one_is_committed(root: Path, oplog: OpLog) -> None:
    store = CheckpointStore(root, keep_last=2)
    store.save(1, payload(1))
    store.save(2, payload(2))
    oplog.ops.clear()
    store.save(3, payload(3))
    ops = oplog.ops
    commit = ops.index(("fsync_dir", "checkpoints", None),
                       next(i for i, op in enumerate(ops) if op[0] == "rename" and op[2] == "step-00000003"))
    touching_old = [i for i, (_, name, _) in enumerate(ops) if name == "step-00000001"]
    assert touching_old and min(touching_old) > commit
    trash = next(op[2] for op in ops if op[:2] == ("rename", "step-00000001"))
    assert trash.startswith(".trash-step-00000001-")
    # renamed away (atomic), made durable, then deleted
    assert ops.index(("rmtree", trash, None)) > ops.index(("rename", "step-00000001", trash)) + 1
    assert step_dirs(root) == ["step-00000002", "step-00000003"]


_KILLED_SAVE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from lodger.checkpoint import CheckpointStore
    sys.path.insert(0, sys.argv[2])
    from test_checkpoint import payload
    store = CheckpointStore(Path(sys.argv[1]), keep_last=2)
    for step in (1, 2, 3):
        store.save(step, payload(step))
""")


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_a_process_killed_at_any_fault_point_leaves_a_good_checkpoint(root: Path, point: str) -> None:
    occurrence = 1 if point == "during_prune" else 3  # the first prune happens in the third save
    env = {**os.environ, "LODGER_FAULT": f"{point}@{occurrence}"}
    done = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(root), str(Path(__file__).parent)],
                          env=env, capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()

    store = CheckpointStore(root, keep_last=2)
    reports = []
    ckpt = store.latest_good(on_damaged=lambda *args: reports.append(args))
    renamed = point in ("before_dir_fsync", "during_prune")  # the kill came after the rename
    assert ckpt.step == (3 if renamed else 2)
    assert ckpt.files == payload(ckpt.step)
    assert reports == []
    store.clean_stale()
    assert sorted(p.name for p in root.iterdir()) == step_dirs(root)
    assert "step-00000002" in step_dirs(root)


def test_safetensors_problem_passes_real_files_and_names_truncated_or_garbage_ones() -> None:
    import torch
    from safetensors.torch import save

    from lodger.checkpoint import safetensors_problem

    good = save({"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 3)})
    assert safetensors_problem(good) is None
    assert safetensors_problem(save({})) is None
    assert "its tensors need" in safetensors_problem(good[:-4])
    assert "header claims" in safetensors_problem(b"\xff" * 64)
    assert "too short" in safetensors_problem(b"\x01\x02")
    assert "unreadable safetensors header" in safetensors_problem((8).to_bytes(8, "little") + b"not json")
