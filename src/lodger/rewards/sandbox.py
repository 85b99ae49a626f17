"""Running code the model wrote: a child process with a time limit, memory and process limits, no
network and a temporary folder of its own, removed afterwards.

What holds it (Linux): a new network namespace (``unshare``; with a new user namespace when lodger
is not root, so no privilege is needed), in which only an unconfigured loopback exists; a mount
namespace of its own in which the whole file system is read-only but its folder (so it cannot
change the owner's files; it may read what its user may read, with nowhere to send it); resource
limits set before ``exec`` (address space, CPU seconds, processes, file size, open files, no core
files); its own session, so the whole process group is killed at the time limit; a fresh empty
folder as its working and home folder; Python in isolated mode (``-I``: no environment variables,
no user site, not the current folder on the path) with a minimal environment. As root, the code
runs as the unprivileged user `nobody` (root ignores the process limit) with a system Python that
user may run. Where no network
namespace can be made (a kernel without unprivileged user namespaces), ``run_python`` refuses
(``SandboxUnavailable``) rather than run the code with the network: `isolate_network=False` is the
owner's explicit choice.

An owner's reward function asks for it with::

    from lodger.rewards.sandbox import run_python
    result = run_python(code, timeout=5, memory_mb=512)
    return 1.0 if result.ok else 0.0
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWNS = 0x10000000, 0x40000000, 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
MOUNT_ATTR_RDONLY, AT_RECURSIVE, AT_FDCWD = 0x1, 0x8000, -100
SYS_MOUNT_SETATTR = 442  # the same number on x86_64 and aarch64 (the generic syscall table)
NOBODY = 65534
OUTPUT_BYTES = 64 * 1024  # what is kept of each stream: enough for a traceback, bounded against floods
FILE_BYTES = 16 * 2**20   # the largest file the code may write
OPEN_FILES = 64


class SandboxUnavailable(RuntimeError):
    """This machine cannot cut the sandboxed code off the network (no network namespace)."""


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None: killed at the time limit
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _read_only_except(libc, folder: str) -> None:
    """In the child's own mount namespace: every mount read-only, ``folder`` writable. Best effort:
    a kernel without mount_setattr (before 5.12) leaves the view as it is."""
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return
    if libc.mount(folder.encode(), folder.encode(), None, MS_BIND | MS_REC, None) != 0:
        return
    read_only = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    if libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(read_only),
                    ctypes.sizeof(read_only)) != 0:
        return
    writable = _MountAttr(0, MOUNT_ATTR_RDONLY, 0, 0)
    libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, folder.encode(), 0, ctypes.byref(writable), ctypes.sizeof(writable))
    os.chdir(folder)  # the working folder was entered before the bind mount covered it: enter the writable one


def _limits(timeout: float, memory_mb: int, processes: int, isolate_network: bool, owner: int | None, folder: str):
    """What the child does between fork and exec (async-signal-safe enough: syscalls only)."""
    def apply() -> None:
        os.setsid()
        libc = ctypes.CDLL(None, use_errno=True)
        if isolate_network:
            flags = CLONE_NEWNET | CLONE_NEWNS | (0 if os.geteuid() == 0 else CLONE_NEWUSER)
            if libc.unshare(flags) != 0:
                os.write(2, b"lodger sandbox: cannot make a network namespace\n")
                os._exit(125)
            _read_only_except(libc, folder)
        cpu = int(timeout) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        memory = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_BYTES, FILE_BYTES))
        resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if owner is not None:  # root is exempt from RLIMIT_NPROC: become nobody first
            os.setgroups([])
            os.setgid(owner)
            os.setuid(owner)
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    return apply


def _interpreter() -> tuple[str, int | None]:
    """(Python to run the code with, user to run it as). As root: `nobody`, with a system Python that
    `nobody` may run (this one may live under /root); without one, this Python as root, in the
    read-only view but without the process limit (root is exempt from it)."""
    if os.geteuid() != 0:
        return sys.executable, None
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        path = os.path.realpath(candidate)
        if _others_may_run(path):
            return path, NOBODY
    return sys.executable, None


def _others_may_run(path: str) -> bool:
    """Whether a user who owns nothing may run ``path``: every folder above it searchable, the file executable."""
    import stat

    try:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        folder = os.path.dirname(path)
        while True:
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return False
            if folder == "/":
                return True
            folder = os.path.dirname(folder)
    except OSError:
        return False


def run_python(code: str, *, timeout: float = 10.0, memory_mb: int = 512, processes: int = 8,
               isolate_network: bool = True) -> SandboxResult:
    """Run ``code`` as a Python program in the sandbox (module docstring); wait at most ``timeout``
    seconds (then the whole process group is killed and ``timed_out`` is True)."""
    folder = tempfile.mkdtemp(prefix="lodger-sandbox-")
    python, owner = _interpreter()
    try:
        script = os.path.join(folder, "main.py")
        with open(script, "w", encoding="utf-8") as fh:
            fh.write(code)
        if owner is not None:
            os.chown(folder, owner, owner)
            os.chown(script, owner, owner)
        env = {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"}
        proc = subprocess.Popen([python, "-I", "-B", script], cwd=folder, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True,
                                preexec_fn=_limits(timeout, memory_mb, processes, isolate_network, owner, folder))
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the code's children go too
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
        if proc.returncode == 125 and b"cannot make a network namespace" in err:
            raise SandboxUnavailable("the sandbox cannot cut the code off the network on this machine (no network "
                                     "namespace: unprivileged user namespaces are disabled); enable them "
                                     "(sysctl kernel.unprivileged_userns_clone=1), or run as root")
        return SandboxResult(None if timed_out else proc.returncode, out[:OUTPUT_BYTES].decode("utf-8", "replace"),
                             err[:OUTPUT_BYTES].decode("utf-8", "replace"), timed_out)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
