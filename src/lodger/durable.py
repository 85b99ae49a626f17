"""The only place that writes files durably.

Every write that must survive a power cut goes through here: write, fsync the file, rename,
fsync the folder. Two test hooks live here too:

- Fault points: ``fault_point(name)`` (from faults.py, where test-only fault injection lives) kills
  the process at once with SIGKILL when ``LODGER_FAULT`` names it (``name`` or ``name@N``).
- A recorder: ``set_recorder(obj)`` receives every durable operation, so a test can rebuild a
  folder from only what had been fsynced at any moment (power-loss simulation).
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import Protocol

from .faults import FAULT_ENV, fault_point  # noqa: F401 (the hook production code calls)


class Recorder(Protocol):
    def record(self, op: str, path: Path, dest: Path | None = None) -> None: ...


_recorder: Recorder | None = None


def set_recorder(recorder: Recorder | None) -> None:
    """Install (or remove, with None) an observer of durable operations; for tests."""
    global _recorder
    _recorder = recorder


def _record(op: str, path: Path, dest: Path | None = None) -> None:
    if _recorder is not None:
        _recorder.record(op, Path(path), None if dest is None else Path(dest))


def is_plain_name(name) -> bool:
    """Whether ``name`` (read from a manifest, storage or anything else outside) is one plain file
    name: joined to a folder, it names an entry of that folder and nothing outside it."""
    return (isinstance(name, str) and name not in ("", ".", "..") and len(name.encode(errors="replace")) <= 255
            and not any(c in name for c in ("/", "\\", "\0")))


def fsync_dir(path: Path) -> None:
    """Make the entries of a folder (creations, renames, deletions) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    _record("fsync_dir", path)


def fsync_file(path: Path) -> None:
    """Make what was written to an existing file (appended lines, say) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    _record("fsync", path)


def mkdir(path: Path) -> None:
    """Create a folder; durable only once its parent is fsynced."""
    path.mkdir(mode=0o700)  # owner-only, like everything lodger keeps (see home.py)
    _record("mkdir", path)


def write_file(path: Path, data, observe=None) -> None:
    """Write a new file and fsync it. Its name is durable only once the folder is fsynced.

    ``data`` is bytes, or an iterable of buffers written in order (a file streamed from memory it
    does not copy); ``observe(chunk)``, when given, sees each buffer just before it is written."""
    chunks = (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as fh:  # owner-only
        _record("create", path)
        for chunk in chunks:
            if observe is not None:
                observe(chunk)
            fh.write(chunk)
        fh.flush()
        os.fsync(fh.fileno())
    _record("fsync", path)


def rename(src: Path, dst: Path) -> None:
    """Atomic rename within one file system; durable once the parent folder is fsynced."""
    os.rename(src, dst)
    _record("rename", src, dst)


def remove_tree(path: Path) -> None:
    """Delete a folder and what it holds (durable once the parent is fsynced)."""
    shutil.rmtree(path, ignore_errors=True)
    _record("rmtree", path)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a reader sees the old or the new content, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write_file(tmp, data)
    rename(tmp, path)
    fsync_dir(path.parent)


def write_folder(final: Path, files: dict, tmp_prefix: str = ".tmp-", replace: bool = False) -> Path:
    """Make ``final`` hold exactly ``files`` (name -> bytes or chunks), appearing whole or not at
    all: written into a hidden sibling, each file and the folder fsynced, renamed into place (an
    older folder of that name removed first when ``replace``), the parent fsynced."""
    final = Path(final)
    if final.exists() and not replace:
        raise FileExistsError(f"{final} already exists")
    bad = [name for name in files if not is_plain_name(name)]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a plain file name for {final}")
    tmp = final.with_name(f"{tmp_prefix}{final.name}-{secrets.token_hex(3)}")
    mkdir(tmp)
    for name, data in files.items():
        write_file(tmp / name, data)
    fsync_dir(tmp)
    if final.exists():
        remove_tree(final)
    rename(tmp, final)
    fsync_dir(final.parent)
    return final
