"""Where a run lives, as one seam: a ``LocalExecutor`` for a run on this machine and a
``RemoteExecutor`` for one on a remote target (remote/), with the same members: ask it to pause
and tell when it has answered, continue it where it lives, where its log and state files are, its
engine's own log, cancel it. ``executor_for`` chooses one, once, from the run's ledger row; the
commands only parse, call and print. No torch: pause, status and logs import this."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import LodgerError, RunStateError
from ..home import run_dir

if TYPE_CHECKING:
    from ..ledger import Ledger

Row = dict[str, Any]  # the run's ledger row


@dataclass(frozen=True)
class Asked:
    """A pause request sent: to which run, the folder its answer appears in, the process asked
    (None: remote, or a run not training), when, and what to say at once (None: nothing)."""

    run: Row
    folder: Path
    pid: int | None
    at: float
    note: str | None = None


class Executor(Protocol):
    def pause(self, ledger: Ledger, run: Row, mode: str) -> Asked: ...

    def answered(self, asked: Asked, hold: bool, since: float) -> str | None: ...

    def resume(self, ledger: Ledger, run: Row) -> str | None: ...

    def folder(self, run: Row) -> Path: ...

    def engine_log(self, run: Row) -> str: ...

    def cancel(self, ledger: Ledger, run: Row) -> bool: ...


class LocalExecutor:
    """A run on this machine: requests through its folder (owner/control.py), its lock (owner/runlock.py)."""

    def pause(self, ledger: Ledger, run: Row, mode: str) -> Asked:
        from ..owner.control import request_pause

        folder = run_dir(run["id"])
        try:
            asked = request_pause(folder, mode, ledger)
        except RunStateError as exc:
            raise RunStateError(f"{exc} (status {run['status']})") from None
        return Asked(run, folder, asked.pid, time.time(), asked.note(run["id"], mode) or None)

    def answered(self, asked: Asked, hold: bool, since: float) -> str | None:
        """What to say once the run has held (``hold``) or given the machine back; None until then.
        A process stopped (Ctrl-Z, SIGSTOP) cannot answer: that is an error naming the fix."""
        from ..owner.control import process_state, run_state
        from ..owner.runlock import is_locked

        run, folder, pid = asked.run, asked.folder, asked.pid
        mode = "hold" if hold else "release"
        if pid is not None and process_state(pid) in ("T", "t"):
            raise RunStateError(f"run {run['id']}: its process {pid} is stopped and cannot {mode} until it is "
                                "continued (Ctrl-Z, SIGSTOP, or `stty tostop` stopping a background process "
                                f"that writes to its terminal); the request stands: `fg` it in its terminal, or "
                                f"`kill -CONT {pid}`")
        if hold:
            state = run_state(folder)
            if state.get("state") == "held" and state.get("time", 0) >= asked.at - 1:
                return (f"{run['id']}: held at step {state.get('step')} "
                        f"({time.monotonic() - since:.2f} s); `lodger resume {run['id']}` continues")
            return None
        if pid is not None and not is_locked(folder) and not _alive(pid):
            # The lock goes before the process: "memory freed" only once the process is gone too.
            state = run_state(folder)
            return (f"{run['id']}: paused at step {state.get('step')}, checkpoint committed, memory freed "
                    f"({time.monotonic() - since:.2f} s)")
        return None

    def resume(self, ledger: Ledger, run: Row) -> str | None:
        """Continue a held run in its own process ("continues..."); None when no process trains it
        and it is to be started here again (the caller does, through lifecycle.Run)."""
        from ..owner.control import request_continue
        from ..owner.runlock import holder, is_locked

        folder = run_dir(run["id"])
        pid = holder(folder)  # a finished run may be held all the same: `lodger eval` scoring it
        if run["status"] == "finished" and pid is None:
            raise RunStateError(f"run {run['id']} already finished; start a new one with `lodger run`")
        if pid is None and is_locked(folder):
            raise RunStateError(f"run {run['id']} is not running as far as lodger can verify: its lock is held, "
                                "but not by the process its lock file names, so nothing was signalled; if an "
                                "older lodger version trains it, wait for that to end")
        if pid is None:
            return None
        still = request_continue(folder, ledger)
        return "continues" + (f" once {', '.join(still)} lets go" if still else "")

    def folder(self, run: Row) -> Path:
        return run_dir(run["id"])

    def engine_log(self, run: Row) -> str:
        raise LodgerError(f"run {run['id']} runs on this machine; it has no Ray log")

    def cancel(self, ledger: Ledger, run: Row) -> bool:
        raise RunStateError(f"run {run['id']} runs on this machine; `lodger pause {run['id']}` stops it "
                            "with a checkpoint")


class RemoteExecutor:
    """A run on a remote target: its backend and its storage (remote/)."""

    def pause(self, ledger: Ledger, run: Row, mode: str) -> Asked:
        from . import pause

        return Asked(run, pause(ledger, run, mode), None, time.time())  # a request file in storage

    def answered(self, asked: Asked, hold: bool, since: float) -> str | None:
        from . import answered_state

        run = asked.run
        if hold:  # the run answers a hold in its state file, as a local one does
            return LocalExecutor.answered(LocalExecutor(), asked, hold, since)
        state = answered_state(run, asked.folder)  # the run answers in its state file when it has stopped
        if state.get("state") in ("paused", "interrupted", "finished") and state.get("time", 0) >= asked.at - 1:
            return (f"{run['id']}: {state['state']} at step {state.get('step')} on {run['target']} "
                    f"({time.monotonic() - since:.2f} s)")
        return None

    def resume(self, ledger: Ledger, run: Row) -> str | None:
        from . import resume

        return resume(ledger, run)

    def folder(self, run: Row) -> Path:
        from . import remote_run_dir

        return remote_run_dir(run)  # the live files, straight from storage

    def engine_log(self, run: Row) -> str:
        from . import job_logs

        return job_logs(run)

    def cancel(self, ledger: Ledger, run: Row) -> bool:
        from . import cancel

        return cancel(ledger, run)


def executor_for(run: Row) -> Executor:
    """Where ``run`` lives, from its ledger row: a remote target's name, or this machine."""
    return RemoteExecutor() if run.get("target") else LocalExecutor()


def wait_answered(asked: Asked, hold: bool, since: float, timeout: float) -> str:
    """Poll the run's answer to a pause request until it comes (what to say) or ``timeout`` seconds
    from ``since`` have passed (an error)."""
    executor = executor_for(asked.run)
    while time.monotonic() - since < timeout:
        said = executor.answered(asked, hold, since)
        if said is not None:
            return said
        time.sleep(0.02)  # a poll inside a bounded wait: the answer is a file and a lock, not an event
    raise LodgerError(f"run {asked.run['id']} did not {'hold' if hold else 'release'} within {timeout:.0f} s")


def _alive(pid: int) -> bool:
    """Whether ``pid`` still exists as a process that has not exited (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
