"""A disk that, at a power cut, keeps only what was made durable: the states a cut can leave.

Built from the system calls a real command made under one folder (tests/syscall_trace.py), it
follows POSIX's rules for what survives a power cut, no more:

- a file's bytes are durable once an fsync (or fdatasync) of that file returned: what the file held
  then; a file never fsynced may come back empty;
- a folder's names (creations, renames, removals in it) are durable once an fsync of that folder
  returned; the name of a new folder needs its parent fsynced, its entries need itself fsynced;
- nothing else is promised: ext4's journal happens to keep more (a rename usually reaches the disk
  with the data before it), other file systems and other mount options do not.

So ``Disk`` keeps, for every inode, its live state and its durable one (taken at its last fsync).
At any cut point k (after the k-th operation) the operations that no fsync had yet covered are the
*pending* ones; a power cut keeps any of them or none. ``Disk.state`` builds one such state from
the durable one plus a chosen selection of pending operations, applied in their order, optionally
with one write torn: a byte prefix of it, some of its 512-byte sectors, or zeros where its data
should be (the size reached the disk, the blocks did not). ``Disk.variants`` draws the four kinds
the power-cut suite checks at a cut: only what fsyncs covered, the pending operations kept in
order up to a random point, a random subset of them, and a prefix with the write in flight torn.
Keeping every pending operation gives the state a SIGKILL leaves (the page cache reaches the disk):
``kill`` below, which is what the kill tests have always seen.
"""

from __future__ import annotations

import bisect
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Union

from syscall_trace import Call, TraceError

Tree = dict[str, Union[bytes, "Tree"]]
SECTOR = 512
EFFECTS = ("link", "unlink", "rename", "write", "truncate")


@dataclass
class Op:
    """One change or sync at inode level. ``ino`` is the file (write, truncate, sync) or the folder
    (link, unlink, rename) it acts on; ``target`` the inode a name is given or taken from."""

    kind: str          # link, unlink, rename, write, truncate, sync, syncall
    path: str          # the path it was made through (messages; telling the ledger's files apart)
    ino: int = -1
    name: str = ""
    target: int = -1
    ino2: int = -1     # rename: the folder the name moves to
    name2: str = ""
    offset: int = 0
    data: bytes = b""
    size: int = 0
    line: int = 0      # in the trace
    segment: int = 0   # which recorded command made it

    def describe(self) -> str:
        what = f"{self.kind} {self.path or '.'}"
        if self.kind == "rename":
            what += f" -> {self.name2}"
        if self.kind == "write":
            what += f" ({len(self.data)} bytes at {self.offset})"
        return f"{what} (command {self.segment + 1}, trace line {self.line})"


def read_tree(folder: Path) -> Tree:
    """A folder as it is on disk, links refused (nothing under a lodger home is a link)."""
    tree: Tree = {}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_symlink():
            raise TraceError(f"{entry.path} is a symbolic link: the power-cut model has no links")
        tree[entry.name] = read_tree(Path(entry.path)) if entry.is_dir() else Path(entry.path).read_bytes()
    return tree


def write_tree(tree: Tree, folder: Path, keep: Callable[[str], bool] = lambda path: True, prefix: str = "") -> Path:
    """Make ``folder`` hold ``tree`` (only the paths ``keep`` accepts)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name, value in tree.items():
        path = f"{prefix}{name}"
        if not keep(path):
            continue
        if isinstance(value, dict):
            write_tree(value, folder / name, keep, path + "/")
        else:
            fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(value)
    return folder


def tree_get(tree: Tree, path: str) -> bytes | Tree | None:
    node: bytes | Tree | None = tree
    for part in [p for p in path.split("/") if p]:
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


class Disk:
    """The live and durable state of one folder through a recorded sequence of system calls."""

    def __init__(self, initial: Tree, watch: Callable[[str], bool] = lambda path: False):
        self.initial = initial
        self.is_dir: dict[int, bool] = {}
        self.entries: dict[int, dict[str, int]] = {}
        self.content: dict[int, bytearray] = {}
        self.root = self._load(initial)
        self.durable_entries = {ino: dict(e) for ino, e in self.entries.items()}  # all of it is on disk
        self.durable_content = {ino: bytes(c) for ino, c in self.content.items()}
        self.ops: list[Op] = []
        self.snapshots: list[tuple[int, dict, dict]] = [(0, dict(self.durable_entries), dict(self.durable_content))]
        self._snapshot_cuts = [0]  # the cut each snapshot holds from
        self.watch = watch
        self.watched: list[tuple[int, dict[str, bytes]]] = []  # (cut, live bytes of watched files) at boundaries
        self._segment = 0
        self._cover: list[int] | None = None

    def _load(self, tree: Tree) -> int:
        ino = len(self.is_dir)
        self.is_dir[ino] = True
        self.entries[ino] = {}
        for name, value in tree.items():
            if isinstance(value, dict):
                self.entries[ino][name] = self._load(value)
            else:
                child = len(self.is_dir)
                self.is_dir[child], self.content[child] = False, bytearray(value)
                self.entries[ino][name] = child
        return ino

    # -- following the calls ---------------------------------------------------------------
    def resolve(self, path: str) -> int | None:
        ino = self.root
        for part in [p for p in path.split("/") if p]:
            if not self.is_dir.get(ino):
                return None
            ino = self.entries[ino].get(part)
            if ino is None:
                return None
        return ino

    def _parent(self, path: str, call: Call) -> tuple[int, str]:
        folder, _, name = path.rpartition("/")
        parent = self.resolve(folder)
        if parent is None or not self.is_dir[parent]:
            raise TraceError(f"trace line {call.line}: {call.name} {path}: its folder is unknown to the model")
        return parent, name

    def _new(self, is_dir: bool) -> int:
        ino = len(self.is_dir)
        self.is_dir[ino] = is_dir
        if is_dir:
            self.entries[ino] = {}
        else:
            self.content[ino] = bytearray()
        return ino

    def follow(self, calls: list[Call]) -> "Disk":
        """Add one recorded command's calls (in order); call again for the next command."""
        for call in calls:
            for op in self._ops(call):
                op.line, op.segment = call.line, self._segment
                self._apply(op)
        if self.ops and self.watch(self.ops[-1].path):
            self._watch_now(len(self.ops))  # the command ended: every call it made had returned
        self._segment += 1
        self._cover = None
        return self

    def _ops(self, call: Call) -> list[Op]:
        path = call.path
        if path.endswith(" (deleted)"):
            return []  # a descriptor of an unlinked file: nothing can reach its bytes any more
        if call.name == "syncall":
            return [Op("syncall", "")]
        if call.name in ("open", "mkdir"):
            ino = self.resolve(path)
            if ino is None and (call.creat or call.name == "mkdir"):
                parent, name = self._parent(path, call)
                return [Op("link", path, parent, name, self._new(call.name == "mkdir"))]
            if ino is not None and call.trunc and not self.is_dir[ino]:
                return [Op("truncate", path, ino, size=0)]
            return []
        if call.name in ("rename", "unlink", "rmdir"):
            target = self.resolve(path)
            if target is None:
                raise TraceError(f"trace line {call.line}: {call.name} of {path}, which the model does not hold")
            parent, name = self._parent(path, call)
            if call.name != "rename":
                return [Op("unlink", path, parent, name, target)]
            parent2, name2 = self._parent(call.dest, call)
            return [Op("rename", path, parent, name, target, parent2, name2)]
        ino = self.resolve(path)
        if ino is None:
            raise TraceError(f"trace line {call.line}: {call.name} of {path}, which the model does not hold")
        if call.name == "fsync":
            return [Op("sync", path, ino)]
        if call.name == "truncate":
            return [Op("truncate", path, ino, size=call.size)]
        offset = len(self.content[ino]) if call.append else call.offset
        return [Op("write", path, ino, offset=offset or 0, data=call.data)]

    def _apply(self, op: Op) -> None:
        before = self.ops[-1] if self.ops else None
        if before is not None and self.watch(before.path) and not self.watch(op.path):
            self._watch_now(len(self.ops))
        self.ops.append(op)
        _change(op, self.entries, self.content)
        if op.kind == "sync":
            self._make_durable([op.ino])
        elif op.kind == "syncall":
            self._make_durable(list(self.is_dir))

    def _make_durable(self, inos: list[int]) -> None:
        for ino in inos:
            if self.is_dir[ino]:
                self.durable_entries[ino] = dict(self.entries[ino])
            else:
                self.durable_content[ino] = bytes(self.content[ino])
        self.snapshots.append((len(self.ops), dict(self.durable_entries), dict(self.durable_content)))
        self._snapshot_cuts.append(len(self.ops))

    def _watch_now(self, cut: int) -> None:
        files = {path: bytes(self.content[ino]) for path, ino in self._walk(self.root, self.entries, "")
                 if not self.is_dir[ino] and self.watch(path)}
        if not self.watched or self.watched[-1][1] != files:
            self.watched.append((cut, files))

    def _walk(self, ino: int, entries: dict[int, dict[str, int]], prefix: str) -> Iterator[tuple[str, int]]:
        for name, child in entries.get(ino, {}).items():
            yield prefix + name, child
            if self.is_dir[child]:
                yield from self._walk(child, entries, prefix + name + "/")

    # -- states a power cut can leave ------------------------------------------------------
    @property
    def cuts(self) -> int:
        """Cut points: 0 (before the first operation) to len(ops) (after the last)."""
        return len(self.ops) + 1

    def cover(self) -> list[int]:
        """For each operation, the index of the first sync that made it durable (len(ops): none)."""
        if self._cover is None:
            syncs: dict[int, list[int]] = {}
            alls = [i for i, op in enumerate(self.ops) if op.kind == "syncall"]
            for i, op in enumerate(self.ops):
                if op.kind == "sync":
                    syncs.setdefault(op.ino, []).append(i)

            def first(ino: int, after: int) -> int:
                found = [s[bisect.bisect_right(s, after)] for s in (syncs.get(ino, []), alls)
                         if bisect.bisect_right(s, after) < len(s)]
                return min(found, default=len(self.ops))

            self._cover = [max(first(op.ino, i), first(op.ino2, i) if op.kind == "rename" else -1)
                           if op.kind in EFFECTS else i for i, op in enumerate(self.ops)]
        return self._cover

    def pending(self, cut: int) -> list[int]:
        """The operations before ``cut`` that no fsync had covered by then (in order)."""
        cover = self.cover()
        return [i for i in range(cut) if self.ops[i].kind in EFFECTS and cover[i] >= cut]

    def state(self, cut: int, keep: list[int] = (), torn: tuple[int, str, random.Random] | None = None) -> Tree:
        """The folder after a cut at ``cut``: the durable state, the pending operations ``keep`` (in
        order), then pending operation ``torn[0]`` torn in mode ``torn[1]`` ("prefix", "sectors",
        "zeros")."""
        at = bisect.bisect_right(self._snapshot_cuts, cut) - 1
        entries, content = dict(self.snapshots[at][1]), dict(self.snapshots[at][2])
        changed: set[int] = set()
        for i in keep:
            self._change_copy(self.ops[i], entries, content, changed)
        if torn is not None:
            index, mode, rng = torn
            self._change_copy(_torn(self.ops[index], mode, content.get(self.ops[index].ino, b""), rng),
                              entries, content, changed)
        return self._materialize(self.root, entries, content)

    def _change_copy(self, op: Op, entries: dict, content: dict, changed: set[int]) -> None:
        """Apply ``op`` to a state's own copies (the snapshots are shared between states)."""
        ino = op.ino
        if ino not in changed:
            changed.add(ino)
            if self.is_dir[ino]:
                entries[ino] = dict(entries.get(ino, {}))
            else:
                content[ino] = bytearray(content.get(ino, b""))
        if op.kind == "rename" and op.ino2 not in changed:
            changed.add(op.ino2)
            entries[op.ino2] = dict(entries.get(op.ino2, {}))
        _change(op, entries, content)

    def _materialize(self, ino: int, entries: dict, content: dict) -> Tree:
        tree: Tree = {}
        for name, child in entries.get(ino, {}).items():
            if self.is_dir[child]:
                tree[name] = self._materialize(child, entries, content)
            else:
                tree[name] = bytes(content.get(child, b""))
        return tree

    def kill(self, cut: int) -> Tree:
        """What a SIGKILL at ``cut`` leaves: every operation kept (the page cache reaches the disk)."""
        return self.state(cut, self.pending(cut))

    def live(self) -> Tree:
        """The folder as the model says it is now, after every operation."""
        return self._materialize(self.root, self.entries, self.content)

    def variants(self, cut: int, rng: random.Random) -> Iterator[tuple[str, Tree]]:
        """The four kinds of state the suite checks at ``cut`` (see the module docstring)."""
        pending = self.pending(cut)
        yield "only what fsyncs covered", self.state(cut)
        upto = rng.randint(0, len(pending))
        yield f"{upto} of {len(pending)} pending operations kept in order", self.state(cut, pending[:upto])
        subset = [i for i in pending if rng.random() < 0.5]
        yield f"a random {len(subset)} of {len(pending)} pending operations kept", self.state(cut, subset)
        writes = [n for n, i in enumerate(pending) if self.ops[i].kind == "write"]
        if writes:
            n = rng.choice(writes)
            mode = rng.choice(("prefix", "sectors", "zeros"))
            yield (f"{n} of {len(pending)} pending operations kept, then {self.ops[pending[n]].describe()} torn "
                   f"({mode})"), self.state(cut, pending[:n], (pending[n], mode, rng))

    def describe_cut(self, cut: int) -> str:
        return f"cut {cut}, after {self.ops[cut - 1].describe()}" if cut else "cut 0, before anything"

    def check_against(self, folder: Path, ignore: Callable[[str], bool] = lambda path: False) -> list[str]:
        """Where the model's live state differs from ``folder`` on disk (a trace it misread)."""
        problems: list[str] = []
        _compare(self.live(), read_tree(folder), "", ignore, problems)
        return problems


def _change(op: Op, entries: dict[int, dict[str, int]], content: dict) -> None:
    """Apply one effect to a state (live, or a power-cut state's copies)."""
    if op.kind == "link":
        entries.setdefault(op.ino, {})[op.name] = op.target
    elif op.kind == "unlink":
        if entries.get(op.ino, {}).get(op.name) == op.target:
            del entries[op.ino][op.name]
    elif op.kind == "rename":
        if entries.get(op.ino, {}).get(op.name) == op.target:
            del entries[op.ino][op.name]
        entries.setdefault(op.ino2, {})[op.name2] = op.target
    elif op.kind == "write":
        data = content.setdefault(op.ino, bytearray())
        end = op.offset + len(op.data)
        if len(data) < op.offset:
            data.extend(bytes(op.offset - len(data)))
        data[op.offset:end] = op.data
    elif op.kind == "truncate":
        data = content.setdefault(op.ino, bytearray())
        del data[op.size:]
        data.extend(bytes(op.size - len(data)))


def _torn(op: Op, mode: str, before: bytes, rng: random.Random) -> Op:
    """Write ``op`` as a power cut may leave it: a byte prefix of its data, some of its sectors (the
    others keep what the file held before), or zeros over its whole range."""
    if mode == "prefix":
        return Op("write", op.path, op.ino, offset=op.offset, data=op.data[:rng.randrange(len(op.data))])
    old = before[op.offset:op.offset + len(op.data)].ljust(len(op.data), b"\0")
    if mode == "zeros":
        return Op("write", op.path, op.ino, offset=op.offset, data=bytes(len(op.data)))
    data = bytearray(op.data)
    start = op.offset
    while start < op.offset + len(op.data):
        end = min((start // SECTOR + 1) * SECTOR, op.offset + len(op.data))
        if rng.random() < 0.5:  # this sector never reached the disk
            data[start - op.offset:end - op.offset] = old[start - op.offset:end - op.offset]
        start = end
    return Op("write", op.path, op.ino, offset=op.offset, data=bytes(data))


def _compare(model: Tree, disk: Tree, prefix: str, ignore: Callable[[str], bool], problems: list[str]) -> None:
    for name in sorted(set(model) | set(disk)):
        path = prefix + name
        if ignore(path):
            continue
        a, b = model.get(name), disk.get(name)
        if a is None or b is None:
            problems.append(f"{path}: {'only the model' if b is None else 'only the disk'} has it")
        elif isinstance(a, dict) != isinstance(b, dict):
            problems.append(f"{path}: a folder on one side, a file on the other")
        elif isinstance(a, dict) and isinstance(b, dict):
            _compare(a, b, path + "/", ignore, problems)
        elif a != b:
            problems.append(f"{path}: {len(a)} bytes in the model, {len(b)} on disk")
