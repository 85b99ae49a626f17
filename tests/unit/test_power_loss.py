"""Power-loss simulation: after a cut at ANY moment, only what had been made durable survives.

``PowerLossRecorder`` is installed with ``durable.set_recorder`` and models a POSIX file system
under power loss:

- a file's durable content is what it held at its last ``fsync`` (read at that moment); a file
  never fsynced comes back empty;
- a folder's durable entries are its entries at its last ``fsync_dir``: name -> node, where a node
  is a file or a folder with its own entries, so a renamed folder keeps what it holds;
- creations, renames and deletions change only the live namespace until the folder is fsynced.

For every cut point k (after each recorded operation) the folder is rebuilt from only the durable
state at k and ``CheckpointStore(rebuilt).latest_good()`` is asked what it would resume from.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Union

import pytest

from lodger import durable
from lodger.checkpoint import _manifest_hash, MANIFEST, CheckpointStore

Tree = dict[str, Union[bytes, "Tree"]]


# -- the simulated file system --------------------------------------------------------------


@dataclass(eq=False)
class Node:
    """A file or folder (an inode). Folders have live and durable entries; files durable content."""

    is_dir: bool
    live: dict[str, "Node"] = field(default_factory=dict)
    durable: dict[str, "Node"] = field(default_factory=dict)
    content: bytes | None = None  # the file's content at its last fsync


def _node_from_disk(path: Path) -> Node:
    if path.is_dir():
        node = Node(is_dir=True)
        for child in path.iterdir():
            node.live[child.name] = _node_from_disk(child)
        node.durable = dict(node.live)
        return node
    return Node(is_dir=False, content=path.read_bytes())


def _materialize(node: Node) -> Tree:
    return {name: _materialize(child) if child.is_dir else (child.content or b"")
            for name, child in node.durable.items()}


def _freeze(tree: Tree) -> tuple:
    return tuple(sorted((name, _freeze(v) if isinstance(v, dict) else v) for name, v in tree.items()))


def rebuild(tree: Tree, folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name, value in tree.items():
        if isinstance(value, dict):
            rebuild(value, folder / name)
        else:
            (folder / name).write_bytes(value)
    return folder


class PowerLossRecorder:
    """Follows every durable operation under ``root`` and keeps the durable state after each one."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.top = _node_from_disk(self.root)  # the root exists durably, with what it holds now
        self.ops: list[tuple[str, str, str | None]] = []
        self.states: list[Tree] = [_materialize(self.top)]  # states[k]: durable state after k ops

    def _parts(self, path: Path) -> list[str] | None:
        try:
            return list(path.relative_to(self.root).parts)
        except ValueError:
            return None

    def _folder(self, parts: list[str]) -> Node:
        node = self.top
        for part in parts:
            if part not in node.live:
                # Created outside durable.py (a plain mkdir): it exists, but nothing made its entry durable.
                node.live[part] = Node(is_dir=True)
            node = node.live[part]
        return node

    def record(self, op: str, path: Path, dest: Path | None = None) -> None:
        parts = self._parts(path)
        if parts is None:
            return
        self.ops.append((op, "/".join(parts), None if dest is None else "/".join(self._parts(dest))))
        parent, name = self._folder(parts[:-1]), parts[-1] if parts else None
        if op == "mkdir":
            parent.live[name] = Node(is_dir=True)
        elif op == "create":
            parent.live[name] = Node(is_dir=False)
        elif op == "fsync":
            parent.live[name].content = path.read_bytes()
        elif op == "rename":
            dest_parts = self._parts(dest)
            self._folder(dest_parts[:-1]).live[dest_parts[-1]] = parent.live.pop(name)
        elif op == "fsync_dir":
            folder = self._folder(parts)
            folder.durable = dict(folder.live)
        elif op in ("rmtree", "unlink"):
            gone = parent.live.pop(name, None)
            stack = [gone] if gone is not None else []
            while stack:  # unlinked, but only the folders' fsyncs would make that durable
                node = stack.pop()
                stack += [c for c in node.live.values() if c.is_dir]
                node.live.clear()
        else:
            raise AssertionError(f"unknown durable operation {op!r}")
        self.states.append(_materialize(self.top))


# -- running saves under the recorder and checking every cut --------------------------------


def payload(step: int, version: int = 0) -> dict[str, bytes]:
    tag = step * 10 + version
    return {
        "adapter_model.safetensors": bytes((tag * 31 + i) % 251 for i in range(64 + step)),
        "optimizer.safetensors": hashlib.sha256(str(tag).encode()).digest() * 3,
        "state.json": json.dumps({"step": step, "version": version}).encode(),
    }


@dataclass
class Save:
    step: int
    files: dict[str, bytes]
    started: int = 0  # ops recorded before this save began
    returned: int = 0  # ops recorded when it returned
    committed: int | None = None  # cut point at which its commit (root fsync after the rename) is done


def record_saves(root: Path, saves: list[Save], make_store: Callable[[Path], CheckpointStore]) -> PowerLossRecorder:
    make_store(root)  # creates the root before the recording starts: it exists durably from then on
    recorder = PowerLossRecorder(root)
    durable.set_recorder(recorder)
    try:
        store = make_store(root)
        for save in saves:
            save.started = len(recorder.ops)
            store.save(save.step, save.files)
            save.returned = len(recorder.ops)
    finally:
        durable.set_recorder(None)
    for save in saves:  # the commit: the first fsync of the root after the rename into step-N
        final = f"step-{save.step:08d}"
        ops = recorder.ops[save.started:save.returned]
        renamed = next((i for i, (op, src, dest) in enumerate(ops)
                        if op == "rename" and dest == final and src.startswith(".tmp-")), None)
        if renamed is not None:
            synced = next((i for i in range(renamed + 1, len(ops)) if ops[i] == ("fsync_dir", "", None)), None)
            if synced is not None:
                save.committed = save.started + synced + 1
    return recorder


@dataclass
class Outcome:
    step: int | None
    files: dict[str, bytes] | None
    damaged: list[str]


def resume_from(tree: Tree, folder: Path) -> Outcome:
    reports: list[str] = []
    ckpt = CheckpointStore(rebuild(tree, folder), keep_last=2).latest_good(
        on_damaged=lambda path, reason, aside: reports.append(reason))
    return Outcome(None if ckpt is None else ckpt.step, None if ckpt is None else ckpt.files, reports)


def problems_at_every_cut(recorder: PowerLossRecorder, saves: list[Save], scratch: Path,
                          window_of: Callable[[Save], bool] = lambda save: False) -> list[str]:
    """Every cut point where resuming would not give the newest committed checkpoint, intact.

    Within ``window_of(save)`` (a re-save of an existing step, which discards the old copy before
    the rename), the checkpoint before the newest one is accepted too.
    """
    found: list[str] = []
    outcomes: dict[tuple, Outcome] = {}
    for k, state in enumerate(recorder.states):
        key = _freeze(state)
        if key not in outcomes:  # equal durable states resume alike; rebuild each distinct one once
            outcomes[key] = resume_from(state, scratch / f"cut-{k:04d}")
        got = outcomes[key]
        where = f"cut {k} (after {recorder.ops[k - 1] if k else 'nothing'})"
        done = [s for s in saves if s.committed is not None and s.committed <= k]
        if got.damaged:
            found.append(f"{where}: damaged checkpoint found: {got.damaged}")
        newest = done[-1] if done else None
        in_window = [s for s in saves if window_of(s) and s.started <= k < (s.committed or len(recorder.ops) + 1)]
        for save in saves:
            if save.returned <= k and (got.step is None or got.step < save.step) and not any(
                    w.step == save.step for w in in_window):
                found.append(f"{where}: save of step {save.step} had returned but resume gives {got.step}")
        if newest is None:
            if got.step is not None:
                found.append(f"{where}: nothing committed yet, resume gives step {got.step}")
            continue
        accepted = {newest.step: newest.files}
        if in_window:
            before = [s for s in done if s.step < newest.step]
            if before:
                accepted[before[-1].step] = before[-1].files
        if got.step not in accepted:
            found.append(f"{where}: resume gives step {got.step}, expected {sorted(accepted)}")
        elif got.files != accepted[got.step]:
            found.append(f"{where}: step {got.step} came back with different files")
    return found


def steps_saves(*steps: int) -> list[Save]:
    return [Save(step, payload(step)) for step in steps]


def correct_store(root: Path) -> CheckpointStore:
    return CheckpointStore(root, keep_last=2)


# -- the real CheckpointStore survives a cut anywhere ----------------------------------------


def test_a_power_cut_after_any_operation_resumes_from_the_newest_committed_checkpoint(tmp_path: Path) -> None:
    saves = steps_saves(10, 20, 30, 40, 50)
    recorder = record_saves(tmp_path / "checkpoints", saves, correct_store)

    assert all(save.committed is not None for save in saves)
    assert sum(op == "rmtree" for op, _, _ in recorder.ops) == 3  # pruning happened: 10, 20, 30 went
    assert len(recorder.states) == len(recorder.ops) + 1 > 60
    assert problems_at_every_cut(recorder, saves, tmp_path / "cuts") == []

    final = resume_from(recorder.states[-1], tmp_path / "final")
    assert (final.step, final.files) == (50, payload(50))
    assert sorted(recorder.states[-1]) == ["step-00000040", "step-00000050"]


def test_before_the_first_commit_a_power_cut_leaves_nothing_to_resume(tmp_path: Path) -> None:
    saves = steps_saves(7)
    recorder = record_saves(tmp_path / "checkpoints", saves, correct_store)
    before_commit = recorder.states[: saves[0].committed]
    assert len(before_commit) > 5
    for k, state in enumerate(before_commit):
        assert resume_from(state, tmp_path / f"cut-{k}").step is None
        assert not any(name.startswith("step-") for name in state)
    assert resume_from(recorder.states[saves[0].committed], tmp_path / "after").files == payload(7)


def test_a_power_cut_while_a_step_is_saved_again_never_loses_both_copies(tmp_path: Path) -> None:
    saves = [Save(1, payload(1)), Save(2, payload(2)), Save(3, payload(3)), Save(3, payload(3, version=1)),
             Save(4, payload(4))]
    recorder = record_saves(tmp_path / "checkpoints", saves, correct_store)
    resave = saves[3]
    assert any(op == "rename" and dest.startswith(".trash-step-00000003-")
               for op, _, dest in recorder.ops[resave.started:resave.returned])
    assert problems_at_every_cut(recorder, saves, tmp_path / "cuts", window_of=lambda s: s is resave) == []


def test_a_power_cut_during_the_next_save_keeps_the_previous_checkpoint_after_clean_up(tmp_path: Path) -> None:
    saves = steps_saves(1, 2, 3)
    recorder = record_saves(tmp_path / "checkpoints", saves, correct_store)
    for k in range(saves[2].started, saves[2].committed):
        folder = rebuild(recorder.states[k], tmp_path / f"cut-{k}")
        store = CheckpointStore(folder, keep_last=2)
        store.clean_stale()
        assert sorted(p.name for p in folder.iterdir()) == ["step-00000001", "step-00000002"]
        assert store.latest_good().files == payload(2)


def test_checkpoints_survive_a_power_cut_even_when_the_store_created_its_own_folder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.toml").write_bytes(b"[training]\nsteps = 3\n")
    recorder = PowerLossRecorder(run)  # the run folder is durable, the checkpoints folder not yet made
    durable.set_recorder(recorder)
    try:
        store = CheckpointStore(run / "checkpoints", keep_last=2)
        store.save(1, payload(1))
    finally:
        durable.set_recorder(None)
    rebuilt = rebuild(recorder.states[-1], tmp_path / "rebuilt")
    ckpt = CheckpointStore(rebuilt / "checkpoints", keep_last=2).latest_good()
    assert ckpt is not None and ckpt.files == payload(1)


# -- the simulator has teeth: broken saves are caught ------------------------------------------


class InPlaceStore(CheckpointStore):
    """Broken on purpose: writes straight into step-N, manifest first, each file made visible at once."""

    def save(self, step: int, files: dict[str, bytes], info: dict | None = None) -> Path:
        final = self.root / f"step-{step:08d}"
        durable.mkdir(final)
        durable.fsync_dir(self.root)
        entries = {n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()}
        manifest = {"format": 1, "step": step, "files": entries}
        manifest["manifest_sha256"] = _manifest_hash(manifest)
        durable.write_file(final / MANIFEST, json.dumps(manifest).encode())
        durable.fsync_dir(final)
        for name, data in files.items():
            durable.write_file(final / name, data)
            durable.fsync_dir(final)
        self.prune()
        return final


def _skip_fsync_dir_of(predicate: Callable[[Path], bool]):
    real = durable.fsync_dir

    def fsync_dir(path: Path) -> None:
        if not predicate(Path(path)):
            real(path)

    return fsync_dir


def _write_without_fsync(path: Path, data, observe=None) -> None:
    chunks = (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data
    with open(path, "wb") as fh:
        durable._record("create", path)
        for chunk in chunks:
            if observe is not None:
                observe(chunk)
            fh.write(chunk)


# flaw -> (durable function replaced, replacement, what the simulator must report)
BROKEN = {
    "no fsync of the temporary folder before the rename": ("fsync_dir", _skip_fsync_dir_of(
        lambda p: p.name.startswith(".tmp-")), "damaged checkpoint found"),
    "files written but never fsynced": ("write_file", _write_without_fsync, "damaged checkpoint found"),
    "checkpoints folder never fsynced": ("fsync_dir", _skip_fsync_dir_of(lambda p: p.name == "checkpoints"),
                                         "had returned but resume gives None"),
    "written in place, manifest first": (None, None, "damaged checkpoint found"),
}


@pytest.mark.parametrize("flaw", BROKEN, ids=list(BROKEN))
def test_the_simulator_catches_a_save_that_breaks_the_protocol(tmp_path: Path, monkeypatch, flaw: str) -> None:
    attribute, replacement, report = BROKEN[flaw]
    if attribute is not None:
        monkeypatch.setattr(durable, attribute, replacement)
    make_store = (lambda root: InPlaceStore(root, keep_last=2)) if attribute is None else correct_store
    saves = steps_saves(1, 2, 3)
    recorder = record_saves(tmp_path / "checkpoints", saves, make_store)
    problems = problems_at_every_cut(recorder, saves, tmp_path / "cuts")
    assert any(report in problem for problem in problems), problems or f"nothing found for: {flaw}"
    # without a power cut the broken save looks fine: only the simulator can tell
    live = CheckpointStore(tmp_path / "checkpoints", keep_last=2).latest_good()
    assert (live.step, live.files) == (3, payload(3))
