"""The inference lease: while requests are in flight, and for a grace period after, training runs
that allow it hold at their next micro-step, so the server gets the CPU or GPU.

It works across processes through the runs' control folders (requester ``serve``) and SIGUSR1;
each run records its own `held` and `continued` events, and the lease records why.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import tomllib

from .. import durable
from ..config import PolicyConfig
from ..owner.control import ask, clear_request, read_requests, wake, write_request
from ..home import run_dir
from ..ledger import Ledger
from ..owner.runlock import is_locked

LOG = logging.getLogger("lodger.serve")


class InferenceLease:
    """While requests are in flight (and a grace period after), eligible runs are asked to hold.

    ``begin()``/``end()`` pair around every request (``end`` in a ``finally``); a background loop
    withdraws the hold requests once the server has been idle for each run's grace period."""

    def __init__(self, enabled: bool = True, poll_seconds: float = 0.2):
        self.enabled = enabled
        self.inflight = 0
        self.last_done = 0.0
        self.holding: dict[str, float] = {}  # run id -> its grace period
        self.lock = threading.Lock()
        self.poll_seconds = poll_seconds
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._release_loop, daemon=True)
        if enabled:
            self.thread.start()

    def _eligible(self) -> dict[str, float]:
        """Live runs whose policy lets inference take the machine, with their grace periods."""
        found = {}
        with Ledger() as ledger:
            for run in ledger.runs():
                if run["status"] not in ("running", "held") or not is_locked(run_dir(run["id"])):
                    continue
                try:  # [policy] read by the job's own model: its defaults live in config.py only
                    policy = PolicyConfig.model_validate(tomllib.loads(run["job_toml"]).get("policy", {}))
                    if policy.enabled and policy.yield_to_inference:
                        found[run["id"]] = float(policy.inference_grace_seconds)
                except (tomllib.TOMLDecodeError, TypeError, ValueError, AttributeError) as exc:
                    LOG.warning("run %s: cannot read its [policy] (%s); it does not yield to inference",
                                run["id"], exc)
        return found

    def begin(self) -> list[str]:
        """A request starts: make sure eligible runs are asked to hold; returns the runs held for it.

        Counted in flight before anything that can fail, so that the caller's ``end()`` (in its
        ``finally``) always balances it; a run that cannot be asked is logged and skipped (the
        request is served anyway, without that run yielding)."""
        if not self.enabled:
            return []
        with self.lock:
            self.inflight += 1
            try:
                eligible = self._eligible()
            except Exception as exc:  # e.g. the ledger locked or unreadable: serve without holding
                LOG.warning("cannot read which runs should hold for inference: %s", exc)
                return list(self.holding)
            for run_id, grace in eligible.items():
                if run_id not in self.holding:
                    self._hold(run_id, grace)
            return list(self.holding)

    def _hold(self, run_id: str, grace: float) -> None:
        folder = run_dir(run_id)
        try:
            write_request(folder, "serve", "hold", "inference requests in flight")
        except Exception as exc:  # an unwritable run folder, a broken control folder, a full disk
            LOG.warning("cannot ask run %s to hold for inference (%s); serving without it yielding", run_id, exc)
            with contextlib.suppress(OSError):
                clear_request(folder, "serve")
            return
        self.holding[run_id] = grace  # from here on the release loop withdraws the request
        try:
            wake(folder)  # only the verified holder of the run's lock is signalled
        except OSError as exc:
            LOG.warning("cannot wake run %s (%s); it sees the hold request at its next look", run_id, exc)

    def end(self) -> None:
        if not self.enabled:
            return
        with self.lock:
            self.inflight -= 1
            self.last_done = time.monotonic()

    def _release_loop(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            with self.lock:
                if self.inflight:
                    continue
                idle = time.monotonic() - self.last_done
                for run_id, grace in list(self.holding.items()):
                    if idle >= grace:
                        self._release(run_id)

    def _release(self, run_id: str) -> None:
        """Withdraw our hold request; on failure keep it listed, so the next poll tries again."""
        folder = run_dir(run_id)
        try:
            if "serve" in read_requests(folder):
                ask(folder, "serve", None)
        except Exception as exc:  # the loop must not die: a hold nobody withdraws stops training for good
            LOG.warning("cannot withdraw the hold of run %s (%s); retrying", run_id, exc)
            return
        del self.holding[run_id]

    def close(self) -> None:
        self._stop.set()
        with self.lock:
            for run_id in list(self.holding):
                self._release(run_id)


SERVE_LOCK = "serve.lock"


class ServeClaim:
    """One server per run: `lodger serve --run R` holds ``runs/R/serve.lock`` (an flock the kernel drops
    when the server dies) for its lifetime. Two servers of one run would each withdraw the inference
    hold the other asked for (they share the run's ``serve`` request), so the second is refused,
    naming the first, before it loads anything."""

    def __init__(self, run_ids: list[str], url: str):
        self.files = []
        try:
            for run_id in run_ids:
                self.files.append(self._claim(run_id, url))
        except BaseException:
            self.release()
            raise

    @staticmethod
    def _claim(run_id: str, url: str):
        import fcntl
        import json
        import os

        from ..errors import RunStateError
        from ..owner.runlock import process_start

        fh = durable.open_file(run_dir(run_id) / SERVE_LOCK, "a+", encoding="utf-8")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            try:
                record = json.loads(fh.read())
            except ValueError:
                record = {}
            fh.close()
            raise RunStateError(f"run {run_id} is already served by pid {record.get('pid', '?')} at "
                                f"{record.get('url', 'an unknown address')}; one server per run (two would each "
                                "withdraw the other's hold on training): use that one, or stop it first") from None
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps({"pid": os.getpid(), "start": process_start(os.getpid()), "url": url}))
        fh.flush()
        return fh

    def release(self) -> None:
        for fh in self.files:
            fh.close()
        self.files = []
