"""What the fault and adversary suite (tests/e2e/test_faults_*.py, bench/faults.py) builds on: a
small file system that really fills up (tests/fault_fs.py), a process frozen at a named point, the
ledger's audit, a command's peak memory, and the mark of the cases too costly for `make test`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fault_fs import fill, free, small_disk  # noqa: F401 (the full-disk cases' file system)
from helpers import describe, lodger_env, run_lodger


def wait_stopped(pid: int, timeout: float = 300) -> None:
    """Until the process is stopped (SIGSTOP at a ``name@N:stop`` fault point); fails if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            raise AssertionError(f"process {pid} ended before reaching its stop point") from None
        if state in ("T", "t"):
            return
        if state == "Z":
            raise AssertionError(f"process {pid} ended before reaching its stop point")
        time.sleep(0.02)  # polling an observed state inside a bounded wait
    raise AssertionError(f"process {pid} did not stop within {timeout} s")


def cont(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


def audit(home: Path, *extra) -> subprocess.CompletedProcess:
    return run_lodger(["audit", *map(str, extra)], lodger_env(home))


def assert_audit_clean(home: Path) -> None:
    result = audit(home)
    assert result.returncode == 0 and "ledger intact" in result.stdout, describe(result)


def no_traceback(result) -> bool:
    text = (result.stdout + result.stderr) if hasattr(result, "stdout") and isinstance(result.stdout, str) \
        else result.stdout() + result.stderr()
    return "Traceback" not in text


def run_measured(args: list, env: dict, timeout: float = 600) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run `lodger ARGS`; return (the result, its peak resident memory in MiB, its wall seconds). The
    peak is the kernel's (wait4's ru_maxrss), of that process and the children it waited for."""
    import tempfile

    from helpers import LODGER

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.monotonic()
        proc = subprocess.Popen([LODGER, *map(str, args)], env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        deadline = started + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)  # polling the child's exit inside a bounded wait
        seconds = time.monotonic() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        result = subprocess.CompletedProcess(args, proc.returncode, out.read().decode(errors="replace"),
                                             err.read().decode(errors="replace"))
    return result, usage.ru_maxrss / 1024, seconds


ALL_ENV = "LODGER_FAULTS_ALL"
expensive = pytest.mark.skipif(not os.environ.get(ALL_ENV), reason=f"an expensive fault case (minutes or GiB): "
                               f"bench/faults.py runs it ({ALL_ENV}=1)")
"""Marks a case too costly for `make test` (a 2 GB line, 10^6 lines, 200 concurrent requests)."""
