"""The lock a training process holds on its run folder: who is training what, without torch."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .errors import RunStateError


class RunLock:
    """An exclusive lock on a run folder, held while a process trains it; the kernel drops it on death."""

    def __init__(self, folder: Path):
        self.fh = open(folder / "lock", "a+")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.fh.seek(0)
            holder = self.fh.read().strip() or "another process"
            self.fh.close()
            raise RunStateError(f"run {folder.name} is already running (pid {holder}); "
                                f"`lodger show {folder.name}` tells its state") from None
        self.fh.seek(0)
        self.fh.truncate()
        self.fh.write(str(os.getpid()))
        self.fh.flush()

    def release(self) -> None:
        self.fh.close()


def is_locked(folder: Path) -> bool:
    """Whether a live process holds the run's lock (i.e. is training it now)."""
    try:
        with open(folder / "lock", "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
    except BlockingIOError:
        return True
    except OSError:
        return False


def lock_pid(folder: Path) -> int | None:
    """The pid written by the process that holds (or last held) the run's lock."""
    try:
        return int((Path(folder) / "lock").read_text().strip())
    except (OSError, ValueError):
        return None
