"""A real file system that loses power: ext4 on a loop device, shut down without flushing its
journal (the power-cut suite's trials beside its model, tests/e2e/test_power_cut_ext4.py).

``EXT4_IOC_SHUTDOWN`` with ``EXT4_GOING_FLAGS_NOLOGFLUSH`` stops the file system at once: every
later read or write fails with EIO and the journal's running transaction is dropped, so after an
unmount and a mount (which replays the journal) it holds what had been committed: what fsyncs
forced out, no more. It is mounted with ``commit=600`` so that jbd2 does not also commit every
5 seconds on its own: a trial then keeps only what lodger fsynced, not what happened to be old
enough. ext4 still keeps more than POSIX promises (an fsync commits the whole running transaction,
other files' names included), which is why the model (tests/power_cut.py) is the stricter test;
this one checks the real file system's side: journal replay, delayed allocation, renames.

Mounting needs root or CAP_SYS_ADMIN and a free loop device; elsewhere the trial is skipped and
says why (as the full-disk cases' tmpfs, tests/fault_fs.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32), linux/fs/ext4/ext4.h
EXT4_GOING_FLAGS_NOLOGFLUSH = 0x2
OPTIONS = "loop,commit=600"


def _run(*command: str) -> str | None:
    """None when ``command`` succeeded, else what it said."""
    done = subprocess.run(command, capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")


@dataclass
class Ext4Disk:
    image: Path
    mount: Path

    def cut_power(self) -> None:
        """Stop the file system as a power cut would: its running journal transaction is lost."""
        fd = os.open(self.mount, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
        finally:
            os.close(fd)

    def remount(self) -> None:
        """The reboot: unmount the dead file system, mount it again (the journal is replayed)."""
        why = _run("umount", str(self.mount)) or _run("mount", "-o", OPTIONS, str(self.image), str(self.mount))
        assert why is None, f"remounting {self.image} at {self.mount}: {why}"


@contextlib.contextmanager
def ext4_disk(folder: Path, size: str = "128M"):
    """A fresh ext4 file system of ``size`` mounted at ``folder/mnt`` for the block's duration (skips
    the test where it cannot be made)."""
    tools = [t for t in ("mkfs.ext4", "mount", "umount") if shutil.which(t) is None]
    if tools:
        pytest.skip(f"no {', '.join(tools)} on this machine: the real-file-system power cuts need them")
    folder.mkdir(parents=True, exist_ok=True)
    disk = Ext4Disk(folder / "ext4.img", folder / "mnt")
    disk.mount.mkdir(exist_ok=True)
    why = _run("truncate", "-s", size, str(disk.image)) or _run("mkfs.ext4", "-q", "-F", str(disk.image))
    if why is None:
        why = _run("mount", "-o", OPTIONS, str(disk.image), str(disk.mount))
        if why is not None:
            why = (f"mounting an ext4 image on a loop device needs root or CAP_SYS_ADMIN and a free loop device; "
                   f"as uid {os.getuid()} `mount -o {OPTIONS}` said: {why}")
    if why is not None:
        pytest.skip(why)
    try:
        yield disk
    finally:
        if _run("umount", str(disk.mount)) is not None:
            _run("umount", "-l", str(disk.mount))
        disk.image.unlink(missing_ok=True)
