"""A small file system that really fills up, for the full-disk fault cases (unit and e2e).

A tmpfs of a few MiB is mounted for the test: writes past its size fail with ENOSPC, exactly as on
a full disk, and freeing it is deleting the filler file. Mounting needs root or CAP_SYS_ADMIN (the
sandbox these tests run in is root); elsewhere the test is skipped and says why. Considered and
not used: RLIMIT_FSIZE (``prlimit --fsize``) raises EFBIG and SIGXFSZ, not ENOSPC; a loop-mounted
ext4 image needs mount too and a file of its size; an LD_PRELOAD shim fakes the error.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest

FILLER = "filler.bin"


def mount_tmpfs(where: Path, size: str) -> str | None:
    """Mount a tmpfs of ``size`` (e.g. "16m") at ``where``; None on success, else why not."""
    where.mkdir(parents=True, exist_ok=True)
    if not shutil.which("mount"):
        return "no `mount` command on this machine"
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        return (f"mounting a tmpfs (the full-disk cases' file system) needs root or CAP_SYS_ADMIN; as uid "
                f"{os.getuid()} `mount -t tmpfs` said: {result.stderr.strip() or result.returncode}")
    return None


def unmount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


@contextlib.contextmanager
def small_disk(where: Path, size: str = "16m"):
    """A file system of ``size`` at ``where`` for the block's duration (skips the test without one)."""
    why = mount_tmpfs(where, size)
    if why:
        pytest.skip(why)
    try:
        yield where
    finally:
        unmount(where)


def fill(disk: Path) -> Path:
    """Take every free byte of ``disk`` with one file (the writer that follows gets ENOSPC)."""
    path = disk / FILLER
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 20, 1 << 16, 1 << 12, 1 << 9):  # down to the last few bytes
            block = b"\0" * size
            while True:
                try:
                    os.write(fd, block)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    finally:
        os.close(fd)
    st = os.statvfs(disk)
    assert st.f_bavail * st.f_frsize < (1 << 12), "the disk did not fill"
    return path


def free(disk: Path) -> None:
    (disk / FILLER).unlink(missing_ok=True)
