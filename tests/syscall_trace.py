"""Every write, sync, creation, rename and removal a command makes under one folder, at the
system-call level, as strace(1) records them (for the power-cut suite, tests/power_cut.py).

Why strace and not lodger's own recorder (durable.set_recorder): a power cut loses what the kernel
was never asked to keep, whoever wrote it, and the interesting writes are the ones that bypass
durable.py (SQLite's pages and WAL frames, a plain ``open()``, a ``mkdir`` in a helper). Only the
system calls show all of them, with their bytes. strace is in Debian's packages and needs no
privilege beyond tracing one's own child (no kernel module, no root, unlike blktrace or dm-log-writes).

The options (``strace_command``):

- ``-f``: follow threads and child processes (the ledger is written from whichever thread asks);
- ``--seccomp-bpf``: the tracee stops only at the calls listed in ``-e trace=``; the thousands of
  reads of torch's imports run at full speed (a traced `lodger run` took 1.3x its time here, not 1.6x);
- ``-y``: each file descriptor is printed with the path the kernel has for it at that call, so a
  write is attributed to its file without replaying every open, dup and close;
- ``-xx``: every string in hex escapes: written bytes come back exact, paths need no unquoting;
- ``-s``: strings this long are printed whole (a write's data); a longer one is refused below,
  never silently cut.

A call that failed changes nothing and is dropped. File positions (``write`` without an offset)
are followed from ``open``/``lseek``; ``power_cut.Disk.check_against`` compares the model's final
files with the disk, so a position this misses is caught, not guessed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

TRACED = ("open", "openat", "creat", "write", "pwrite64", "writev", "pwritev", "pwritev2", "lseek", "fsync",
          "fdatasync", "sync", "syncfs", "rename", "renameat", "renameat2", "unlink", "unlinkat", "mkdir",
          "mkdirat", "rmdir", "ftruncate", "truncate", "link", "linkat", "symlink", "symlinkat", "sendfile",
          "copy_file_range", "fallocate")
"""Every call that can change a file's bytes or a folder's names, or make them durable (those lodger
never makes under its home, sendfile and links, are traced so that using them is refused, not missed)."""
MAX_STRING = 64 << 20
UNSUPPORTED = ("link", "linkat", "symlink", "symlinkat", "sendfile", "copy_file_range", "fallocate")


def strace_command(trace: Path) -> list[str]:
    """The strace prefix that records into ``trace`` (see the module docstring for each option)."""
    strace = shutil.which("strace")
    if strace is None:
        raise FileNotFoundError("strace is not installed (Debian: `apt-get install strace`); the power-cut "
                                "suite records lodger's system calls with it")
    return [strace, "-f", "-qq", "--seccomp-bpf", "-y", "-xx", f"-s{MAX_STRING}", "-o", str(trace),
            "-e", "trace=" + ",".join(TRACED)]


def record(command: list[str], trace: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``command`` under strace, its system calls into ``trace``; the command's own result."""
    return subprocess.run(strace_command(trace) + [str(a) for a in command], env=env, capture_output=True,
                          text=True, timeout=timeout)


@dataclass
class Call:
    """One system call that succeeded and touched the traced folder; paths are relative to it."""

    line: int        # in the trace, for messages
    tid: int
    name: str        # "open", "write", "truncate", "fsync", "syncall", "rename", "unlink", "rmdir", "mkdir"
    path: str = ""
    dest: str = ""   # a rename's new name
    data: bytes = b""
    offset: int | None = None  # a write's file offset (None: at the descriptor's position)
    size: int = 0    # a truncate's length
    append: bool = False  # written through an O_APPEND descriptor
    creat: bool = False   # an open that may create the file (O_CREAT)
    trunc: bool = False   # an open that empties it (O_TRUNC)


_LINE = re.compile(rb"^(\d+)\s+(.*)$")
_CALL = re.compile(rb"^(\w+)\((.*)\)\s+=\s+(-?\d+|0x[0-9a-f]+|\?)(.*)$")
_FD = re.compile(rb"^(\d+|AT_FDCWD)<((?:\\x[0-9a-f]{2})*)>$")
_STRING = re.compile(rb'^"((?:\\x[0-9a-f]{2})*)"(\.\.\.)?$')


def _hex(text: bytes) -> bytes:
    return bytes.fromhex(text.replace(b"\\x", b"").decode())


def _split(args: bytes) -> list[bytes]:
    """Top-level arguments: commas inside quotes, brackets or a descriptor's <path> do not split."""
    out, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(args):
        c = chr(ch)
        if quoted:
            quoted = c != '"'
        elif c == '"':
            quoted = True
        elif c in "[{(<":
            depth += 1
        elif c in "]})>":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(args[start:i].strip())
            start = i + 1
    tail = args[start:].strip()
    return out + ([tail] if tail else [])


class TraceError(AssertionError):
    """The trace holds something the model cannot follow; the message names the line."""


class Parser:
    """Turns strace lines into ``Call``s under ``root``; descriptors' positions followed per (fd, path)."""

    def __init__(self, root: Path):
        real = os.path.realpath(root).encode()
        self.prefixes = sorted({real, str(root).encode()}, key=len, reverse=True)
        self.positions: dict[tuple[int, bytes], int] = {}
        self.appending: set[tuple[int, bytes]] = set()
        self.pending: dict[int, bytes] = {}  # a thread's unfinished call, by tid

    def relative(self, path: bytes | None) -> str | None:
        if path is None:
            return None
        path = os.path.normpath(path)
        for prefix in self.prefixes:
            if path == prefix:
                return ""
            if path.startswith(prefix + b"/"):
                return path[len(prefix) + 1:].decode("utf-8", "surrogateescape")
        return None

    def _string(self, arg: bytes, number: int) -> bytes:
        match = _STRING.match(arg)
        if match is None:
            raise TraceError(f"trace line {number}: expected a string, got {arg[:80]!r}")
        if match.group(2):
            raise TraceError(f"trace line {number}: a string longer than strace's -s {MAX_STRING} was cut; "
                             "raise syscall_trace.MAX_STRING")
        return _hex(match.group(1))

    def _fd(self, arg: bytes, number: int) -> tuple[int | None, bytes | None]:
        match = _FD.match(arg)
        if match is None:
            return None, None  # a plain number: no path known (not under the root, e.g. a pipe)
        fd = None if match.group(1) == b"AT_FDCWD" else int(match.group(1))
        return fd, _hex(match.group(2))

    def _path(self, args: list[bytes], at: bool, number: int, which: int = 0) -> bytes:
        if at:
            _, base = self._fd(args[which], number)
            name = self._string(args[which + 1], number)
        else:
            base, name = None, self._string(args[which], number)
        if name.startswith(b"/"):
            return name
        if base is None:
            raise TraceError(f"trace line {number}: relative path {name!r} with no folder known")
        return os.path.join(base, name)

    def parse(self, trace: Path) -> list[Call]:
        calls: list[Call] = []
        with open(trace, "rb") as fh:
            for number, raw in enumerate(fh, 1):
                call = self._line(raw.rstrip(b"\n"), number)
                if call is not None:
                    calls.append(call)
        return calls

    def _line(self, raw: bytes, number: int) -> Call | None:
        match = _LINE.match(raw)
        if match is None:
            return None
        tid, text = int(match.group(1)), match.group(2)
        if text.endswith(b"<unfinished ...>"):
            self.pending[tid] = text[: -len(b"<unfinished ...>")].rstrip()
            return None
        if text.startswith(b"<... "):
            head = self.pending.pop(tid, None)
            if head is None:
                raise TraceError(f"trace line {number}: a resumed call that never started")
            text = head + text.split(b"resumed>", 1)[1]
        if text.startswith((b"+++", b"---")):
            return None  # exits and signals
        call = _CALL.match(text)
        if call is None:
            raise TraceError(f"trace line {number}: cannot read {text[:120]!r}")
        name, args, ret = call.group(1).decode(), _split(call.group(2)), call.group(3)
        if ret == b"?" or ret.startswith(b"-"):
            return None  # failed (or never returned: the process died in it): nothing changed
        return self._call(number, tid, name, args, int(ret, 0), call.group(4).strip())

    def _call(self, number: int, tid: int, name: str, args: list[bytes], ret: int, rest: bytes) -> Call | None:
        rel = self.relative
        if name in ("open", "openat", "creat"):
            at = name == "openat"
            flags = b"O_WRONLY|O_CREAT|O_TRUNC" if name == "creat" else args[2 if at else 1]
            opened = _FD.match(b"%d" % ret + rest) if rest.startswith(b"<") else None
            real = _hex(opened.group(2)) if opened else self._path(args, at, number)  # the kernel's own path
            where = rel(real)
            if where is None:
                return None
            self.positions[(ret, real)] = 0
            (self.appending.add if b"O_APPEND" in flags else self.appending.discard)((ret, real))
            return Call(number, tid, "open", where, creat=b"O_CREAT" in flags, trunc=b"O_TRUNC" in flags)
        if name in UNSUPPORTED:
            touched = [self._fd(a, number)[1] for a in args] + [_hex(m) for m in re.findall(rb'"((?:\\x[0-9a-f]{2})*)"',
                                                                                            b",".join(args))]
            if any(rel(p) is not None for p in touched if p):
                raise TraceError(f"trace line {number}: {name} under the traced folder: the power-cut model does "
                                 "not follow it (its data is not in the trace); write through durable.py instead")
            return None
        if name in ("sync", "syncfs"):
            return Call(number, tid, "syncall")
        if name in ("write", "pwrite64", "writev", "pwritev", "pwritev2", "lseek", "fsync", "fdatasync", "ftruncate"):
            fd, path = self._fd(args[0], number)
            where = rel(path)
            if where is None or fd is None:
                return None
            return self._fd_call(number, tid, name, args, ret, fd, path, where)
        if name in ("rename", "renameat", "renameat2"):
            at = name != "rename"
            src, dst = self._path(args, at, number), self._path(args, at, number, 2 if at else 1)
            if name == "renameat2" and b"RENAME_EXCHANGE" in args[-1]:
                raise TraceError(f"trace line {number}: RENAME_EXCHANGE is not modelled")
            if rel(src) is None and rel(dst) is None:
                return None
            if rel(src) is None or rel(dst) is None:
                raise TraceError(f"trace line {number}: a rename into or out of the traced folder")
            return Call(number, tid, "rename", rel(src), rel(dst))
        if name in ("unlink", "unlinkat", "rmdir"):
            at = name == "unlinkat"
            path = rel(self._path(args, at, number))
            if path is None:
                return None
            gone_dir = name == "rmdir" or (at and b"AT_REMOVEDIR" in args[2])
            return Call(number, tid, "rmdir" if gone_dir else "unlink", path)
        if name in ("mkdir", "mkdirat"):
            path = rel(self._path(args, name == "mkdirat", number))
            return None if path is None else Call(number, tid, "mkdir", path)
        if name == "truncate":
            path = rel(self._path(args, False, number))
            return None if path is None else Call(number, tid, "truncate", path, size=int(args[1]))
        raise TraceError(f"trace line {number}: {name} is traced but not read")

    def _fd_call(self, number: int, tid: int, name: str, args: list[bytes], ret: int, fd: int, path: bytes,
                 where: str) -> Call | None:
        key = (fd, path)
        if name == "lseek":
            self.positions[key] = ret
            return None
        if name in ("fsync", "fdatasync"):
            return Call(number, tid, "fsync", where)
        if name == "ftruncate":
            return Call(number, tid, "truncate", where, size=int(args[1]))
        if name in ("writev", "pwritev", "pwritev2"):
            data = b"".join(self._string(s, number) for s in re.findall(rb'iov_base=("[^"]*"(?:\.\.\.)?)', args[1]))
        else:
            data = self._string(args[1], number)
        data = data[:ret]
        if name in ("pwrite64", "pwritev", "pwritev2"):
            return Call(number, tid, "write", where, data=data, offset=int(args[-1] if name == "pwrite64" else args[3]))
        append = key in self.appending
        offset = None if append else self.positions.get(key, 0)
        self.positions[key] = self.positions.get(key, 0) + len(data)
        return Call(number, tid, "write", where, data=data, offset=offset, append=append)
