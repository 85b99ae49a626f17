"""The lock a training process holds on its run folder: who is training what, without torch.

The lock file says which process took the lock, as JSON: ``{"pid": 1234, "start": "..."}``, the
start being the process's start time (with the boot it belongs to). A pid alone names whichever
process has that number now: the run's trainer, or, once it has died, any process of the owner's.
So a process is signalled only when it still holds the lock, its start time is the recorded one,
and, where the kernel lists who took which lock (Linux /proc/locks), that list names it too
(``holder``). Lock files that are empty, garbage or a bare pid (written by older lodger
versions) name nobody lodger can trust: the run counts as not running, and nothing is signalled.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from .. import durable
from ..errors import RunStateError

LOCK = "lock"


class RunLock:
    """An exclusive lock on a run folder, held while a process trains it; the kernel drops it on death."""

    def __init__(self, folder: Path):
        fd = durable.open_created(Path(folder) / LOCK, os.O_RDWR)
        self.fh = os.fdopen(fd, "r+")
        if not _take(fd):
            self.fh.close()
            pid = holder(folder)
            who = f"pid {pid}" if pid else "a process lodger cannot identify"
            raise RunStateError(f"run {Path(folder).name} is already running ({who}); "
                                f"`lodger show {Path(folder).name}` tells its state") from None
        record = json.dumps({"pid": os.getpid(), "start": process_start(os.getpid())})
        # One write of a few bytes at offset 0, then cut what an older, longer record left: a reader
        # in between sees a record that does not parse (not trusted), never someone else's pid.
        os.pwrite(fd, record.encode(), 0)
        os.ftruncate(fd, len(record.encode()))

    def release(self) -> None:
        self.fh.close()


def _take(fd: int, patience: float = 1.0) -> bool:
    """Take the lock; False if another process holds it. ``is_locked`` takes it for an instant to
    look, so a refusal is believed only once it has lasted ``patience`` seconds."""
    deadline = time.monotonic() + patience
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)  # a poll inside a bounded wait: a look lasts microseconds


def is_locked(folder: Path) -> bool:
    """Whether a live process holds the run's lock (i.e. something is training it now)."""
    return flock_held(Path(folder) / LOCK)


def flock_held(path: Path) -> bool:
    """Whether a live process holds an flock on ``path`` (the kernel drops it when that process dies)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # no lock file: nobody ever took it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # also drops the lock if we just took it


def _record(folder: Path) -> dict | None:
    """The lock file's record, or None when it is missing, empty, garbage or an old bare pid."""
    try:
        record = json.loads((Path(folder) / LOCK).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or type(record.get("pid")) is not int or record["pid"] <= 1:
        return None  # pid 0, 1 and negatives name process groups or init, never a run
    if not isinstance(record.get("start"), str):
        return None
    return record


def lock_pid(folder: Path) -> int | None:
    """The pid the lock file records (informational: it may be dead or reused; see ``holder``)."""
    record = _record(folder)
    return record["pid"] if record else None


def holder(folder: Path) -> int | None:
    """The pid of the process that took the run's lock and holds it now, or None.

    None when nobody holds the lock, when the lock file names nobody trustworthy, or when the
    process with the recorded pid started at another time than the one that took the lock."""
    record = _record(folder)
    if record is None or not is_locked(folder):
        return None
    if process_start(record["pid"]) != record["start"]:
        return None
    takers = _lock_takers(Path(folder) / LOCK)
    if takers is not None and record["pid"] not in takers:
        return None  # the record names a live process, but another one took the lock
    return record["pid"]


def _lock_takers(path: Path) -> set[int] | None:
    """The pids that took a lock on ``path``, from the kernel's list (Linux /proc/locks); None where
    there is no such list. A file anyone can write cannot name a process there."""
    try:
        st = path.stat()
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    takers = set()
    for line in text.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; a waiter's line has "->" after the number
        if len(fields) >= 6 and fields[1] != "->" and fields[5] == inode:
            try:
                takers.add(int(fields[4]))
            except ValueError:
                pass
    return takers


def process_start(pid: int) -> str | None:
    """When process ``pid`` started, as an opaque string that differs between any two processes
    that ever had this pid (on Linux: the boot id and the start time in clock ticks); None if gone."""
    if _HAVE_PROC:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                # The command name (field 2) may hold spaces and ')': split after its last ')'.
                fields = fh.read().rsplit(")", 1)[1].split()
            return f"{_BOOT_ID}:{int(fields[19])}"  # field 22 of proc(5); fields[0] is field 3
        except (OSError, ValueError, IndexError):
            return None
    try:
        import psutil

        return f"psutil:{psutil.Process(pid).create_time():.6f}"
    except Exception:  # noqa: BLE001 - NoSuchProcess, AccessDenied: nothing we can vouch for
        return None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "?"


_HAVE_PROC = Path("/proc/self/stat").exists()
_BOOT_ID = _boot_id()
