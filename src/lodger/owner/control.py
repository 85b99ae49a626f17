"""How a running job is told to pause, hold, continue or stop, and how it answers.

Requests are small JSON files in ``runs/<run>/control/``, one per requester (``user``, ``agent``,
``serve``, ``limit``), so that one requester's "continue" never cancels another's "hold". The
strongest request wins: release > hold > run. A requester asks through ``ask``: it writes its
file, then SIGUSR1 goes to the process that took the run's lock (and to no other) so the run
notices at once; the run answers in ``control/state.json`` and in the ledger.

- release: abandon the current step (its gradients are dropped and the RNG put back as it was
  at the step's start), commit a checkpoint, exit. Frees all memory.
- hold: stop at the next yield point, keep memory, sleep (no CPU) until released.

Yield points are every micro-step boundary and, inside a micro-step, the start of each
transformer layer's forward and backward (``yield_point()``, installed by the loop), in training
steps and in evaluations alike: a hold or a release is answered within one layer's compute, not
one micro-step's or one eval's, which under load on a 135M model is the difference between tens
of milliseconds and tens of seconds. Holding there changes nothing (the computation just waits);
a release there drops the partial step as above, or abandons the eval (it is run again on resume).
Time spent held is counted in ``held_seconds``, so step times and throughput can leave it out.

SIGTERM or a first Ctrl-C: checkpoint at the next step boundary and exit 0; a second Ctrl-C
exits at once. Every check costs an attribute read unless a signal arrived.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import durable
from .runlock import holder, process_start

REQUESTERS = ("user", "agent", "serve", "limit")
LAPSING = ("agent", "serve")  # their requests lapse when the process that made them is gone (a crash)
STRENGTH = {"run": 0, "hold": 1, "release": 2}
HOLD_POLL_SECONDS = 0.25  # while held: a few wake-ups a second, far below 1% of a core
REMOTE_POLL_SECONDS = 0.5  # a remote run looks at its control folder at most this often


def control_dir(run_folder: Path) -> Path:
    return Path(run_folder) / "control"


def write_request(run_folder: Path, requester: str, state: str, reason: str, **measured) -> None:
    """Ask a run to hold, release or run (``state``); the strongest request of all requesters wins."""
    if requester not in REQUESTERS or state not in STRENGTH:
        raise ValueError(f"bad control request {requester}/{state}")
    folder = durable.make_dirs(control_dir(run_folder))
    body = {"state": state, "by": requester, "reason": reason, "time": time.time(), **measured}
    if requester in LAPSING:
        body["pid"], body["start"] = os.getpid(), process_start(os.getpid())
    durable.atomic_write(folder / f"{requester}.json", json.dumps(body).encode())


def clear_request(run_folder: Path, requester: str) -> None:
    durable.remove(control_dir(run_folder) / f"{requester}.json")  # a cut must not bring a lifted hold back


def read_requests(run_folder: Path) -> dict[str, dict]:
    found = {}
    for requester in REQUESTERS:
        try:
            request = json.loads((control_dir(run_folder) / f"{requester}.json").read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(request, dict):
            continue  # not a request lodger wrote
        if requester in LAPSING and not _alive(request):
            continue  # a dead server or agent cannot let go of its hold: it lapses instead
        found[requester] = request
    return found


def _alive(request: dict) -> bool:
    """Whether the process that wrote a lapsing request still runs (the same one, not a reused pid)."""
    pid = request.get("pid")
    if type(pid) is not int or pid <= 1:
        return False
    start = process_start(pid)
    return start is not None and request.get("start", start) == start


def effective(requests: dict[str, dict]) -> dict:
    """The strongest request, or a plain "run"."""
    best = {"state": "run", "by": None, "reason": None}
    for request in requests.values():
        if STRENGTH.get(request.get("state"), 0) > STRENGTH[best["state"]]:
            best = request
    return best


def run_state(run_folder: Path) -> dict:
    """What the run last said about itself (``running`` or ``held``), or {}."""
    try:
        return json.loads((control_dir(run_folder) / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def ask(run_folder: Path, requester: str, state: str | None, reason: str = "", *, ledger=None,
        event: dict | None = None, **measured) -> int | None:
    """Ask the run in ``run_folder`` to hold, release or run (``state``), or withdraw
    ``requester``'s request (``state`` None); the one way anything asks a run to act.

    Writes (or removes) the request file, records ``event`` ({"kind": ..., **fields}) in ``ledger``
    when both are given, and wakes the process that trains the run. Returns the pid woken, or None
    when no process verifiably trains it now (see ``runlock.holder``): then nothing is signalled,
    and the request waits in its file for whichever process trains the run next."""
    if state is None:
        clear_request(run_folder, requester)
    else:
        write_request(run_folder, requester, state, reason, **measured)
    if ledger is not None and event is not None:
        fields = dict(event)
        ledger.event(Path(run_folder).name, fields.pop("kind"), **fields)
    return wake(run_folder)


@dataclass(frozen=True)
class Asked:
    """What ``request_pause`` did: the pid asked, and the stopped processes it continued for it."""

    pid: int
    continued: tuple[int, ...] = ()

    def note(self, run_id: str, mode: str) -> str:
        """What the owner is told about a run that was stopped, or ''."""
        if not self.continued:
            return ""
        what = "checkpoint and exit" if mode == "release" else "hold (it keeps its memory, uses no CPU)"
        return (f"run {run_id}: its process {self.pid} was stopped (Ctrl-Z, or SIGSTOP), where it cannot answer; "
                f"continued it (SIGCONT to pid{'s' if len(self.continued) > 1 else ''} "
                f"{', '.join(map(str, self.continued))}) to {what}")


def request_pause(run_folder: Path, mode: str, ledger, why: str = "lodger pause") -> Asked:
    """The owner asks the local run in ``run_folder`` to release (checkpoint and exit) or hold;
    `lodger pause` and `lodger ui` both ask through here. Raises RunStateError when no process
    verifiably trains the run now (nothing is written then).

    A process stopped by Ctrl-Z or SIGSTOP receives the request's SIGUSR1 only once continued: the
    owner would wait with no answer. It is continued (with what the terminal stopped beside it), so
    that it answers now; a hold then keeps it where a stop kept it. One stopped by a debugger is
    left to the debugger: the request is recorded, and the owner told so at once."""
    from ..errors import RunStateError
    from .runlock import is_locked

    run_id = Path(run_folder).name
    pid = holder(run_folder)
    if pid is None:
        unverified = ("; its lock is held, but not by the process its lock file names (nothing was signalled): "
                      "if an older lodger trains it, wait for it to end") if is_locked(run_folder) else ""
        raise RunStateError(f"run {run_id} is not training now{unverified}")
    state = process_state(pid)
    ask(run_folder, "user", mode, why, ledger=ledger, event={"kind": "pause_requested", "mode": mode, "by": "user"})
    if state == "t":
        raise RunStateError(f"run {run_id}: its process {pid} is stopped by a debugger (tracing stop); the {mode} "
                            "request is recorded, and the run answers it once the debugger lets it go on")
    return Asked(pid, tuple(continue_stopped(pid)) if state == "T" else ())


def process_state(pid: int) -> str | None:
    """The state letter of proc(5) (R, S, D, T stopped, t traced, Z...) of ``pid``; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def continue_stopped(pid: int) -> list[int]:
    """SIGCONT to the stopped process ``pid`` (the verified holder of a run's lock) and to the
    stopped processes of its process group: what Ctrl-Z stopped with it (the command that started
    it, its other ranks). Each is signalled by its pid, never the group; returns the pids continued."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            group = int(fh.read().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return []
    stopped = [pid]
    # Our own group was not stopped by a terminal (we run): its other stopped processes are not the run's.
    for entry in os.scandir("/proc") if group != os.getpgrp() else ():
        if not entry.name.isdigit() or int(entry.name) == pid:
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] == "T" and int(fields[2]) == group:
            stopped.append(int(entry.name))
    continued = []
    for each in stopped:
        try:
            os.kill(each, signal.SIGCONT)
            continued.append(each)
        except (ProcessLookupError, PermissionError):
            continue  # gone, or not the owner's: nothing of ours to continue
    return continued


def request_continue(run_folder: Path, ledger) -> list[str]:
    """Withdraw the owner's (and the agent's) pause of a live, held run: what `lodger resume` does
    for a run whose process still holds it. Returns the requesters that still hold it; raises
    RunStateError when the run is neither held nor asked to be."""
    from ..errors import RunStateError

    requests = read_requests(run_folder)
    held = run_state(run_folder).get("state") == "held"  # e.g. by a server that died: its hold lapsed
    if not held and not any(r.get("state") != "run" for r in requests.values()):
        raise RunStateError(f"run {Path(run_folder).name} is training (or being evaluated) now; nothing to resume")
    clear_request(run_folder, "agent")
    ask(run_folder, "user", None, ledger=ledger, event={"kind": "resume_requested", "by": "user"})
    return [k for k, v in read_requests(run_folder).items() if v.get("state") != "run"]


def wake(run_folder: Path) -> int | None:
    """Send SIGUSR1 to the process that took the run's lock and still holds it, and to no other."""
    pid = holder(run_folder)
    return pid if pid is not None and notify(pid) else None


def notify(pid: int | None) -> bool:
    """SIGUSR1 to ``pid`` as given: False if it is gone or not ours. Never a group (pid 0 or below).

    Only for a pid already known to be the run's (tests, ``wake``): a pid read from a lock file
    may have been reused by any process of the owner's, which SIGUSR1 would kill; use ``wake``."""
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, signal.SIGUSR1)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


class ReleaseRequested(Exception):
    """Raised inside a step when the run must give the machine back now."""


class Control:
    """The run's side: signal handlers, the micro-step check, holding and releasing."""

    def __init__(self, run_folder: Path | None = None, since: float | None = None):
        self.folder = run_folder
        # Requests written before ``since`` are not for this process (an eval of a paused run must
        # not answer the pause its training got); None: every request counts.
        self.since = since
        self.stop: str | None = None       # why a stop at the next step boundary was requested
        self.release: dict | None = None   # the request that asks to release the machine now
        self.on_hold: Callable[[dict], None] = lambda request: None
        self.on_continue: Callable[[dict, float], None] = lambda request, seconds: None
        self.step = 0
        self._interrupts = 0
        self._dirty = run_folder is not None  # read requests once at start
        # Inside a micro-step's forward/backward or an eval: work a release may drop (and redo later).
        self.in_step = False
        self.held_seconds = 0.0  # total time spent held in this process
        # A run on a remote target gets no SIGUSR1 from the machine that asks: it notices new
        # request files by their mtimes instead (a few stats every half second).
        self._poll_at = 0.0 if run_folder is not None and os.environ.get("LODGER_REMOTE") == "1" else None
        self._requests_seen: tuple | None = None

    def request_stop(self, reason: str) -> None:
        if self.stop is None:
            self.stop = reason

    def wake(self) -> None:
        """Look at the requests at the next micro-step (what SIGUSR1 does, from inside the run)."""
        self._dirty = True

    def install_signal_handlers(self) -> "Control":
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self  # a Ray Train worker runs ranks in a thread: no signals there, requests come by file
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_int)
        signal.signal(signal.SIGUSR1, self._on_usr1)
        return self

    def checkpoint_boundary(self, release_ok: bool = True) -> None:
        """Called between micro-steps: answer hold and release requests. Cheap when nothing changed.

        With ``release_ok`` false (at a yield point outside a step or an eval, where there is no
        work to drop) a hold is answered here and a release is left for the next boundary."""
        if self._poll_at is not None:
            self._poll_files()
        if not self._dirty:
            return
        self._dirty = False
        request = effective(self._requests())
        if request["state"] == "release":
            if not release_ok:
                self._dirty = True
                return
            self.release = request
            raise ReleaseRequested(request.get("reason"))
        if request["state"] == "hold":
            self._hold(request, release_ok)

    def yield_point(self, *_ignored) -> None:
        """Called at each layer inside forward and backward (module and tensor hooks)."""
        if self._dirty:
            self.checkpoint_boundary(release_ok=self.in_step)

    def _hold(self, request: dict, release_ok: bool = True) -> None:
        started = time.monotonic()
        self.announce("held", request)
        self.on_hold(request)
        looks = 0
        while not self.stop:
            time.sleep(HOLD_POLL_SECONDS)  # a signal (SIGUSR1, SIGTERM) marks us dirty; we look then
            looks += 1
            if self._poll_at is not None:
                self._poll_files()
            if self._dirty or looks % 20 == 0:  # and every few seconds, in case the holder died
                self._dirty = False
                current = effective(self._requests())
                if current["state"] == "release":
                    if not release_ok:
                        self._dirty = True  # answered at the next micro-step boundary
                        break
                    self.release = current
                    raise ReleaseRequested(current.get("reason"))
                if current["state"] != "hold":
                    break
                self.announce("held", current)  # a new hold request gets its own answer
        held = time.monotonic() - started
        self.held_seconds += held
        self.announce("running", request)
        self.on_continue(request, held)

    def _requests(self) -> dict[str, dict]:
        found = read_requests(self.folder)
        if self.since is None:
            return found
        return {k: r for k, r in found.items() if isinstance(r.get("time"), (int, float)) and r["time"] >= self.since}

    def _poll_files(self) -> None:
        now = time.monotonic()
        if now < self._poll_at:
            return
        self._poll_at = now + REMOTE_POLL_SECONDS
        seen = tuple(_mtime(control_dir(self.folder) / f"{r}.json") for r in REQUESTERS)
        if seen != self._requests_seen:  # written, rewritten or removed since the last look
            self._requests_seen = seen
            self._dirty = True

    def announce(self, state: str, request: dict | None = None) -> None:
        if self.folder is None:
            return
        body = {"state": state, "pid": os.getpid(), "step": self.step, "time": time.time(),
                "by": (request or {}).get("by"), "reason": (request or {}).get("reason")}
        durable.atomic_write(durable.make_dirs(control_dir(self.folder)) / "state.json", json.dumps(body).encode())

    def _on_usr1(self, signum, frame) -> None:
        self.wake()

    def _on_term(self, signum, frame) -> None:
        self.request_stop("SIGTERM")
        self._dirty = self.folder is not None

    def _on_int(self, signum, frame) -> None:
        self._interrupts += 1
        if self._interrupts >= 2:
            os.write(2, b"\nsecond Ctrl-C: exiting now without a checkpoint\n")
            os._exit(130)
        os.write(2, b"\nCtrl-C: committing a checkpoint at the next step boundary (Ctrl-C again to quit now)\n")
        self.request_stop("SIGINT")
