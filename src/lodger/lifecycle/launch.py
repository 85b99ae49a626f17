"""A run in the background: a detached worker process per run (``lodger _worker RUN``, which trains
it through ``Run``), logging to the run folder, and the waits until it has taken the run or trains."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from .. import durable
from ..owner.control import run_state
from ..errors import LodgerError
from ..home import run_dir


def spawn_worker(run_id: str, *, fresh: bool, extra: list[str] | None = None) -> subprocess.Popen[bytes]:
    """A new session (survives the terminal closing) that trains ``run_id``; output to worker.out."""
    folder = run_dir(run_id)
    log = durable.open_file(folder / "worker.out", "ab")
    command = [sys.executable, "-m", "lodger.cli.main", "_worker", run_id] + (["--fresh"] if fresh else [])
    command += list(extra or [])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True, env=env)
    finally:
        log.close()


def wait_until_running(run_id: str, process: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    """Return once the worker says it is training; raise with its output if it died first."""
    folder = run_dir(run_id)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = run_state(folder)
        # With world_size > 1 the worker becomes the rank supervisor; rank 0, its grandchild, answers.
        answered = state.get("state") in ("running", "held", "finished", "paused")
        if answered and _descends_from(state.get("pid"), process.pid):
            return
        if _ended(run_id, process):
            return
        time.sleep(0.1)
    raise LodgerError(f"the background run {run_id} did not start within {timeout:.0f} s; see {folder}/worker.out")


def wait_until_taken(run_id: str, process: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    """Return once the worker holds the run's lock (it then answers pause requests), in about
    the time a Python interpreter takes to start; raise with its output if it died first."""
    from ..owner.runlock import is_locked, lock_pid

    folder = run_dir(run_id)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if lock_pid(folder) == process.pid and is_locked(folder):
            return
        if _ended(run_id, process):
            return
        time.sleep(0.02)
    raise LodgerError(f"the background run {run_id} did not start within {timeout:.0f} s; see {folder}/worker.out")


def _ended(run_id: str, process: subprocess.Popen[bytes]) -> bool:
    """True if the worker already finished well; raise with its output if it failed."""
    code = process.poll()
    if code is None or code == 0:
        return code == 0
    tail = (run_dir(run_id) / "worker.out").read_text(errors="replace")[-2000:]
    raise LodgerError(f"the background run {run_id} exited with status {code}:\n{tail}")


def _descends_from(pid: int | None, ancestor: int, depth: int = 3) -> bool:
    """Whether ``pid`` is ``ancestor`` or its child, grandchild... (Linux /proc)."""
    for _ in range(depth + 1):
        if not pid or pid <= 1:
            return False
        if pid == ancestor:
            return True
        try:
            with open(f"/proc/{pid}/stat") as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False
