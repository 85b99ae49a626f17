"""The only place that writes files durably.

Every write that must survive a power cut goes through here: write, fsync the file, rename,
fsync the folder. A name (a file or folder made, renamed or removed) is durable only once its
folder is fsynced, so every helper that makes or removes one fsyncs the folder before it returns:
``make_dirs``, ``open_created`` (and ``open_file``, ``open_append``, which fsync the folder once,
when they made the file, not at every append), ``remove``, ``atomic_write``, ``write_folder``.
tests/e2e/test_power_cut.py checks that at every moment a power cut can strike. Two test hooks live
here too:

- Fault points: ``fault_point(name)`` (from faults.py, where test-only fault injection lives) kills
  the process at once with SIGKILL when ``LODGER_FAULT`` names it (``name`` or ``name@N``).
- A recorder: ``set_recorder(obj)`` receives every durable operation, so a test can rebuild a
  folder from only what had been fsynced at any moment (power-loss simulation).

A full file system (ENOSPC, or a quota's EDQUOT) is never an unexplained OSError: the half-written
file is removed and ``errors.DiskFull`` names the path, the space needed and what is free there.
Files lodger appends to in a run folder are opened without following a symbolic link
(``open_append``): a link planted there cannot make lodger write outside it.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Protocol

from .errors import DiskFull, LodgerError
from .faults import FAULT_ENV, fault_point  # noqa: F401 (the hook production code calls)

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


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


def is_plain_name(name: object) -> bool:
    """Whether ``name`` (read from a manifest, storage or anything else outside) is one plain file
    name: joined to a folder, it names an entry of that folder and nothing outside it."""
    return (isinstance(name, str) and name not in ("", ".", "..") and len(name.encode(errors="replace")) <= 255
            and not any(c in name for c in ("/", "\\", "\0")))


def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` says the file system (or the owner's quota) is full: an OSError, or a library's
    own error carrying the OS's words (safetensors' Rust writer raises SafetensorError)."""
    if isinstance(exc, DiskFull):
        return True
    if isinstance(exc, OSError):
        return exc.errno in NO_SPACE
    text = str(exc)
    return "No space left on device" in text or "Disk quota exceeded" in text


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the file system holding ``path`` (or the
    nearest folder above it that exists); None when it cannot be asked."""
    path = Path(path)
    for folder in (path, *path.parents):
        try:
            st = os.statvfs(folder)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return None


def disk_full(path: Path, needed: int | None = None, what: str = "") -> DiskFull:
    """The error for a write to ``path`` that found no space (the free space is measured now)."""
    path = Path(path)
    return DiskFull(path, needed, free_bytes(path), what, folder=path.parent)


def file_kind(path: Path) -> str | None:
    """What ``path`` is when it is not a regular file that can be read to its end without blocking
    ("a named pipe (FIFO)", "a character device", "a folder", ...; links followed), or None when it
    is one (or does not exist: the caller says that in its own words)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_created(path: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open(path, flags | O_CREAT)``; when this call made the file, its name is made durable (the
    folder fsynced) before it returns, so a power cut cannot take the file away once it is in use.

    The usual case (the file exists) costs one open; a new file one open more and one folder fsync."""
    path = Path(path)
    plain = flags & ~(os.O_CREAT | os.O_EXCL)
    try:
        return os.open(path, plain)
    except FileNotFoundError:
        pass
    try:
        fd = os.open(path, plain | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:  # made by another process meanwhile: its name is made durable here all the same
        fd = os.open(path, plain)
    try:
        _record("create", path)
        fsync_dir(path.parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


_FILE_MODES = {"a": os.O_WRONLY | os.O_APPEND, "a+": os.O_RDWR | os.O_APPEND, "r+": os.O_RDWR}


def open_file(path: Path, mode: str = "a", **kwargs: Any) -> IO[Any]:
    """A file object for ``path`` opened in ``mode`` ("a", "a+", "r+", with "b" for bytes), the file
    made (owner-only) when missing, with its name durable (``open_created``): logs and lock files."""
    fd = open_created(path, _FILE_MODES[mode.replace("b", "")] | os.O_CLOEXEC)
    return os.fdopen(fd, mode, **kwargs)


def open_append(path: Path) -> IO[str]:
    """Open text file ``path`` for appending, line-buffered (created owner-only, its name durable),
    refusing to follow a symbolic link: a link planted in a run folder (log.txt -> ~/.bashrc) must not
    make lodger write where it points."""
    try:
        fd = open_created(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LodgerError(f"{path} is a symbolic link (to {os.readlink(path)}); lodger does not write through "
                              f"links in its own folders. Remove it (`rm {path}`) and run the command again") from None
        if is_no_space(exc):
            raise disk_full(Path(path), what="opening it to append") from None
        raise
    return os.fdopen(fd, "a", buffering=1, encoding="utf-8")


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
    """Create a folder; durable only once its parent is fsynced (``make_dirs`` does both)."""
    path.mkdir(mode=0o700)  # owner-only, like everything lodger keeps (see home.py)
    _record("mkdir", path)


def make_dirs(path: Path) -> Path:
    """``path`` as a folder, made owner-only with its missing parents; the name of each folder made
    here is durable (its parent fsynced) before this returns. A folder that exists already is taken
    as durable: it was made by this function, or has outlived the cut that could have taken it."""
    path = Path(path)
    missing = []
    folder = path
    while not folder.is_dir():
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            if not folder.is_dir():
                raise
        _record("mkdir", folder)
        fsync_dir(folder.parent)  # made by another process meanwhile, maybe: fsynced here all the same
    return path


def remove(path: Path) -> bool:
    """Delete file ``path``, the deletion durable (the folder fsynced) before this returns; False
    when there was nothing to delete."""
    path = Path(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    _record("unlink", path)
    fsync_dir(path.parent)
    return True


def sync_tree(folder: Path) -> None:
    """Every file and folder under ``folder`` (written by a library that does not fsync: a model
    writer, a GGUF converter) made durable, before one rename makes the folder visible."""
    folder = Path(folder)
    for path in sorted(folder.rglob("*"), reverse=True):
        if path.is_symlink():
            continue
        if path.is_file():
            fsync_file(path)
        else:
            fsync_dir(path)
    fsync_dir(folder)


def write_file(path: Path, data: bytes | bytearray | memoryview | Iterable[Any],
               observe: Callable[[Any], None] | None = None) -> None:
    """Write a new file and fsync it. Its name is durable only once the folder is fsynced.

    ``data`` is bytes, or an iterable of buffers written in order (a file streamed from memory it
    does not copy); ``observe(chunk)``, when given, sees each buffer just before it is written."""
    chunks: Iterable[Any] = data
    size: int | None = None  # known for a whole buffer, for the error when it does not fit
    if isinstance(data, (bytes, bytearray, memoryview)):
        chunks, size = (data,), len(data)
    try:
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as fh:  # owner-only
            _record("create", path)
            for chunk in chunks:
                if observe is not None:
                    observe(chunk)
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        if not is_no_space(exc):
            raise
        try:  # what fitted of it is garbage now: give its space back
            os.unlink(path)
        except OSError:
            pass
        raise disk_full(path, size) from None
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
    try:
        write_file(tmp, data)
    except DiskFull as exc:  # name the file the user knows, not its hidden sibling
        raise exc.explain(path=path) from None
    fault_point("atomic_before_rename")
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
    try:
        mkdir(tmp)
        for name, data in files.items():
            write_file(tmp / name, data)
    except (DiskFull, OSError) as exc:
        if isinstance(exc, OSError) and not is_no_space(exc):
            raise
        remove_tree(tmp)
        sizes = [len(d) for d in files.values() if isinstance(d, (bytes, bytearray, memoryview))]
        raise disk_full(final, sum(sizes) if len(sizes) == len(files) else None) from None
    fsync_dir(tmp)
    fault_point("folder_before_rename")
    if final.exists():
        remove_tree(final)
    rename(tmp, final)
    fsync_dir(final.parent)
    return final
