"""Running code the model wrote: a child process with a time limit, memory and process limits, no
network and a temporary folder of its own, removed afterwards.

What holds it (Linux): a new network namespace (``unshare``; with a new user namespace when lodger
is not root, so no privilege is needed), in which only an unconfigured loopback exists; resource
limits set before ``exec`` (address space, CPU seconds, processes, file size, open files, no core
files); its own session, so the whole process group is killed at the time limit; a fresh empty
folder as its working and home folder; Python in isolated mode (``-I``: no environment variables,
no user site, not the current folder on the path) with a minimal environment. As root, the code
runs as the unprivileged user `nobody` (root ignores the process limit). Where no network
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

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
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


def _limits(timeout: float, memory_mb: int, processes: int, isolate_network: bool, owner: int | None):
    """What the child does between fork and exec (async-signal-safe enough: syscalls only)."""
    def apply() -> None:
        os.setsid()
        if isolate_network:
            libc = ctypes.CDLL(None, use_errno=True)
            flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
            if libc.unshare(flags) != 0:
                os.write(2, b"lodger sandbox: cannot make a network namespace\n")
                os._exit(125)
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


def _read(pipe) -> str:
    data = pipe.read(OUTPUT_BYTES) if pipe else b""
    return data.decode("utf-8", errors="replace")


def run_python(code: str, *, timeout: float = 10.0, memory_mb: int = 512, processes: int = 8,
               isolate_network: bool = True) -> SandboxResult:
    """Run ``code`` as a Python program in the sandbox (module docstring); wait at most ``timeout``
    seconds (then the whole process group is killed and ``timed_out`` is True)."""
    folder = tempfile.mkdtemp(prefix="lodger-sandbox-")
    owner = NOBODY if os.geteuid() == 0 else None
    try:
        script = os.path.join(folder, "main.py")
        with open(script, "w", encoding="utf-8") as fh:
            fh.write(code)
        if owner is not None:
            os.chown(folder, owner, owner)
            os.chown(script, owner, owner)
        env = {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"}
        proc = subprocess.Popen([sys.executable, "-I", "-B", script], cwd=folder, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True,
                                preexec_fn=_limits(timeout, memory_mb, processes, isolate_network, owner))
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
