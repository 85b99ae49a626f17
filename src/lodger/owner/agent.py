"""`lodger agent`: yield policies and the job queue, applied by one long-running, light process.

Every ``interval`` seconds the agent measures the machine (other processes' CPU and memory share,
GPU memory where there is a GPU, battery, the clock), asks each live run's policy whether it must
yield, and holds or releases it (or lets it continue once every condition has been clear for the
policy's ``clear_seconds``). It also restarts managed runs that died (a reboot, a kill), continues
runs it paused itself, and starts queued jobs when there is room. Every decision is a ledger event
with its reason and the measured values. The agent never imports torch. What it measures, and
how a measurement becomes reasons to yield, is owner/machine.py.
"""

from __future__ import annotations

import fcntl
import functools
import os
import subprocess
import sys
import time
import tomllib
import traceback
from pathlib import Path

from .. import durable
from .control import ask, clear_request, read_requests
from ..home import home, run_dir
from ..ledger import Ledger
from .machine import Sampler, violations
from .restarts import RESTARTABLE, Backoff, being_started, decide
from .runlock import flock_held, holder, is_locked


# -- the agent -------------------------------------------------------------------------------
def _seconds(value) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    from ..errors import JobFileError

    raise JobFileError(f"{home() / 'config.toml'}: [agent] starting_grace = {value!r}: give seconds as a number "
                       ">= 0 (e.g. starting_grace = 600)")


def queued_run_id(name: str) -> str:
    """The id a queued job's run gets (the form of session.new_run_id; the agent imports no torch)."""
    import secrets

    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def queue_log(queue_id: int) -> Path:
    return durable.make_dirs(home() / "queue") / f"{queue_id}.out"


class StarterLock:
    """Held by the `_start-queued` process until its run exists: while held, the entry is not lost."""

    def __init__(self, queue_id: int):
        self.fh = durable.open_file(queue_log(queue_id).with_suffix(".lock"), "a+")
        fcntl.flock(self.fh, fcntl.LOCK_EX)

    def release(self) -> None:
        self.fh.close()


def starter_busy(queue_id: int) -> bool:
    return flock_held(home() / "queue" / f"{queue_id}.lock")


def agent_lock_path() -> Path:
    return home() / "agent.lock"


def agent_log_path() -> Path:
    """Where the agent writes the tracebacks of errors it survived."""
    return home() / "agent.log"


ERROR_REMINDER_SECONDS = 600.0


def _append_log(path: Path, text: str) -> None:
    try:
        with durable.open_file(path, "a", encoding="utf-8") as fh:
            fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
    except OSError:
        pass  # the log is a help, not a reason to stop


def agent_pid() -> int | None:
    """The pid of the running agent, or None."""
    path = agent_lock_path()
    if not path.exists():
        return None
    with durable.open_file(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            fh.seek(0)
            text = fh.read().strip()
            return int(text) if text.isdigit() else -1


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    """A detached lodger process (its own session, output to ``log``)."""
    out = durable.open_file(log, "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "lodger.cli.main", *args], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    finally:
        out.close()


class Agent:
    """One tick at a time: measure, apply policies, restart what should run, start queued jobs."""

    def __init__(self, ledger: Ledger, interval: float = 1.0, max_concurrent: int | None = None,
                 backoff: Backoff | None = None):
        from ..lifecycle.jobfile import user_defaults

        settings = user_defaults().get("agent", {})
        self.ledger = ledger
        self.interval = interval
        self.max_concurrent = max_concurrent or int(settings.get("max_concurrent", 1))
        self.sampler = Sampler()
        self.look_again_soon = False  # set by a tick that saw a load half-way to a limit
        self.clear_since: dict[str, float] = {}
        self.starting: dict[str, subprocess.Popen] = {}   # restarted runs, until their worker holds the lock
        self.queue_children: dict[int, subprocess.Popen] = {}  # queued jobs being started
        self.starting_grace = _seconds(settings.get("starting_grace", 600))  # before a lost start is requeued
        self.backoff = backoff or Backoff()
        self.errors: dict[str, dict] = {}  # where -> the error failing there now: text, count, when logged

    def _policy(self, run: dict):
        return _policy_of(run["job_toml"])

    def _threads(self, run_or_toml: str) -> int:
        try:
            return int(tomllib.loads(run_or_toml).get("training", {}).get("threads") or os.cpu_count())
        except (tomllib.TOMLDecodeError, AttributeError, TypeError, ValueError):
            return os.cpu_count() or 1  # unreadable: counted as using every core; its own look says why

    def tick(self) -> None:
        runs = self.ledger.runs()
        holders = {r["id"]: holder(run_dir(r["id"])) for r in runs if is_locked(run_dir(r["id"]))}
        # Locked, but not by the process the lock file names: lodger neither signals nor restarts it.
        unverified = {run_id for run_id, pid in holders.items() if pid is None}
        live = {r["id"]: r for r in runs if holders.get(r["id"])}
        for run_id, child in list(self.starting.items()):
            if run_id in holders or child.poll() is not None:
                del self.starting[run_id]
        for queue_id, child in list(self.queue_children.items()):
            row = self.ledger.queue_entry(queue_id)
            if child.poll() is not None or (row and row["run_id"] in holders):
                del self.queue_children[queue_id]
        pids = set(holders.values()) - {None}
        pids |= {c.pid for c in [*self.starting.values(), *self.queue_children.values()] if c.poll() is None}
        measured = self.sampler.measure(pids, want_gpu=self._wants_gpu(live))
        for run in runs:
            if run["id"] in self.starting or run["id"] in unverified:
                continue
            try:  # one run's bad files or record must not keep the agent from the others
                self._look_at(run, live, measured)
                self.errors.pop(f"run {run['id']}", None)
            except Exception as exc:
                self.log_error(f"run {run['id']}", exc)
        self._settle_starting()
        busy = len(holders) + len(self.starting) + len(self.queue_children)
        self._start_queued(busy, sum(self._threads(r["job_toml"]) for r in live.values()))

    def _wants_gpu(self, live: dict) -> bool:
        """Whether a live run's policy looks at GPU memory. A policy that cannot be read is skipped
        here, so that it fails (and is logged) for its own run only, not for the whole tick."""
        for run in live.values():
            try:
                if self._policy(run).max_foreign_gpu_memory:
                    return True
            except Exception:
                continue
        return False

    def _look_at(self, run: dict, live: dict, measured: dict) -> None:
        if run["id"] in live:
            self._apply_policy(run, measured)
        elif "user" in read_requests(run_dir(run["id"])):
            return  # the owner paused or held it: it stays so until `lodger resume`
        elif run["managed"] and not run.get("target") and run["status"] in RESTARTABLE:
            self._restart_dead(run)
        elif run["status"] == "paused" and self._paused_by_agent(run["id"]):
            if self._clear_for_long_enough(run, measured):
                self._restart(run, "conditions clear: continuing the run it released", measured)

    def _restart_dead(self, run: dict) -> None:
        """Start a managed run with no live process again: at once, after a growing delay, or never."""
        if being_started(run_dir(run["id"])):
            return  # its creator, or a worker still loading the model, is bringing it up
        decision = decide(self.ledger.events(run["id"]), self.backoff)
        if decision.action == "restart":
            why = ("the run was created but never started" if run["status"] == "created"
                   else f"the run's process is gone (status {run['status']})")
            self._restart(run, f"{why}: resuming" + (f" (try {decision.failed + 1})" if decision.failed else ""),
                          failed=decision.failed)
        elif decision.action == "delay":
            self.ledger.event(run["id"], "restart_delayed", failed_tries=decision.failed,
                              delay_seconds=decision.delay, last_status=run["status"],
                              reason=f"try {decision.failed} ended without a checkpoint; the next one in "
                                     f"{decision.delay:g} s")
        elif decision.action == "give_up":
            self.ledger.set_status(run["id"], "gave_up", "gave_up", failed_tries=decision.failed,
                                   last_status=run["status"], step=run["step"],
                                   reason=f"{decision.failed} tries in a row ended without a checkpoint; "
                                          f"`lodger resume {run['id']}` tries again")

    def _apply_policy(self, run: dict, measured: dict) -> None:
        policy = self._policy(run)
        folder = run_dir(run["id"])
        mine = read_requests(folder).get("agent")
        reasons = violations(policy, measured) if policy.enabled else []
        if (not reasons and mine is None and policy.enabled and policy.max_foreign_cpu is not None
                and measured["foreign_cpu"] > policy.max_foreign_cpu / 2):
            # A load that began part-way through this interval shows as part of itself: look
            # again soon rather than a whole interval later (serve_forever), so the owner waits
            # about one interval for the machine, not two.
            self.look_again_soon = True
        if reasons and mine is None:
            ask(folder, "agent", policy.yield_mode, "; ".join(reasons), measured=measured, ledger=self.ledger,
                event={"kind": "policy", "decision": policy.yield_mode, "reasons": reasons, "measured": measured})
            self.clear_since.pop(run["id"], None)
        elif mine is not None and self._clear_for_long_enough(run, measured, reasons):
            ask(folder, "agent", None, ledger=self.ledger, event={"kind": "policy", "decision": "continue",
                "reasons": [f"clear for {policy.clear_seconds:g} s"], "measured": measured})

    def _clear_for_long_enough(self, run: dict, measured: dict, reasons: list[str] | None = None) -> bool:
        policy = self._policy(run)
        reasons = violations(policy, measured) if reasons is None else reasons
        if reasons:
            self.clear_since.pop(run["id"], None)
            return False
        since = self.clear_since.setdefault(run["id"], time.monotonic())
        if time.monotonic() - since >= policy.clear_seconds:
            self.clear_since.pop(run["id"], None)
            return True
        return False

    def _paused_by_agent(self, run_id: str) -> bool:
        paused = self.ledger.last_event(run_id, "paused")
        return bool(paused) and paused["data"].get("by") == "agent"

    def _restart(self, run: dict, reason: str, measured: dict | None = None, failed: int = 0) -> None:
        folder = run_dir(run["id"])
        clear_request(folder, "agent")
        self.ledger.event(run["id"], "agent_resume", reason=reason, measured=measured,
                          **({"failed_tries": failed} if failed else {}))
        self.ledger.update_run(run["id"], managed=1)
        # A run that never started has nothing to resume from: start it as new (segment 0).
        fresh = run["status"] == "created" and not any((folder / "checkpoints").glob("step-*"))
        self.starting[run["id"]] = spawn(["_worker", run["id"], *(["--fresh"] if fresh else [])],
                                         folder / "worker.out")

    def _start_queued(self, busy: int, threads_in_use: int) -> None:
        """queued -> starting(run id, time, our pid), then a `_start-queued` process creates the run.

        Only a job whose text matches the sha256 its `queued` event carries is started."""
        for entry in self.ledger.queue():
            problem = self.ledger.queue_text_problem(entry["id"], entry["job_toml"])
            if problem:
                self._refuse(entry, problem)
                continue
            threads = self._threads(entry["job_toml"])
            room = busy < self.max_concurrent and (busy == 0 or threads_in_use + threads <= (os.cpu_count() or 1))
            if not room:
                return
            run_id = queued_run_id(entry["name"])
            if not self.ledger.take_from_queue(entry["id"], run_id, os.getpid()):
                continue
            self.queue_children[entry["id"]] = spawn(["_start-queued", str(entry["id"]), run_id],
                                                     queue_log(entry["id"]))
            busy += 1
            threads_in_use += threads

    def _refuse(self, entry: dict, problem: str) -> None:
        if self.ledger.queue_move(entry["id"], "queue_refused", ("queued",), reason=problem):
            message = f"agent: refused queued job #{entry['id']} ({entry['name']}): {problem}\n"
            with durable.open_file(queue_log(entry["id"]), "a", encoding="utf-8") as fh:
                fh.write(message)
            sys.stderr.write(message)  # the agent's own output is its log

    def _settle_starting(self) -> None:
        """A `starting` entry whose run appeared is started; one whose run never will is queued again."""
        for entry in self.ledger.queue("starting"):
            if starter_busy(entry["id"]):
                continue  # a `_start-queued` process is creating the run right now
            if entry["run_id"] and self.ledger.has_run(entry["run_id"]):
                self.ledger.queue_move(entry["id"], "queue_started", ("starting",), entry["run_id"],
                                       run_id=entry["run_id"])
                continue
            reason = self._lost_start(entry)
            if reason:
                self.ledger.queue_move(entry["id"], "queue_requeued", ("starting",), reason=reason,
                                       lost_run_id=entry["run_id"])
                self.queue_children.pop(entry["id"], None)

    def _lost_start(self, entry: dict) -> str | None:
        """Why a `starting` entry's run will never appear (None: give it time)."""
        pid, child = entry["agent_pid"], self.queue_children.get(entry["id"])
        if pid == os.getpid():
            if child is None or child.poll() is not None:
                return "its starter process ended before the run existed"
        elif not pid or not Path(f"/proc/{pid}").exists():
            return f"the agent that took it (pid {pid}) is gone and no run {entry['run_id']} exists"
        waited = time.time() - (entry["starting_at"] or 0)
        if waited > self.starting_grace:
            return f"no run {entry['run_id']} after {waited:.0f} s (grace {self.starting_grace:g} s)"
        return None

    def safe_tick(self) -> bool:
        """One tick; an exception in it is logged with its traceback, and the next tick comes as usual."""
        try:
            self.tick()
            self.errors.pop("tick", None)
            return True
        except Exception as exc:
            self.log_error("tick", exc)
            return False

    def log_error(self, where: str, exc: Exception) -> None:
        """A new error: its traceback to the agent log, a line to stderr, an event. The same error
        again: counted, and a one-line reminder at most every ERROR_REMINDER_SECONDS (an agent
        looking every second at a broken file must not fill the disk with copies of one traceback)."""
        text, now, path = f"{type(exc).__name__}: {exc}", time.monotonic(), agent_log_path()
        seen = self.errors.get(where)
        if seen is not None and seen["text"] == text:
            seen["count"] += 1
            if now - seen["logged"] < ERROR_REMINDER_SECONDS:
                return
            seen["logged"] = now
            _append_log(path, f"still failing in {where} ({seen['count']} times): {text}\n")
            return
        self.errors[where] = {"text": text, "count": 1, "logged": now}
        _append_log(path, f"error in {where}: {text}\n" + "".join(traceback.format_exception(exc)))
        print(f"agent: error in {where}: {text} (traceback in {path}); going on", file=sys.stderr, flush=True)
        try:
            self.ledger.event(None, "agent_error", where=where, error=text, log=str(path))
        except Exception:
            pass  # e.g. the ledger itself is what fails: the log has it

    def serve_forever(self, stop_after: float | None = None) -> None:
        started = time.monotonic()
        while stop_after is None or time.monotonic() - started < stop_after:
            self.look_again_soon = False
            self.safe_tick()
            time.sleep(self.interval / 4 if self.look_again_soon else self.interval)


@functools.lru_cache(maxsize=256)
def _policy_of(job_toml: str):
    """A run's policy, parsed once per recorded job rather than several times every tick."""
    from ..config import JobConfig

    return JobConfig.model_validate(tomllib.loads(job_toml)).policy


class AgentLock:
    """Only one agent per $LODGER_HOME."""

    def __init__(self):
        self.fh = durable.open_file(agent_lock_path(), "a+")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.fh.close()
            from ..errors import RunStateError

            raise RunStateError(f"an agent is already running (pid {agent_pid()})") from None
        self.fh.seek(0)
        self.fh.truncate()
        self.fh.write(str(os.getpid()))
        self.fh.flush()
