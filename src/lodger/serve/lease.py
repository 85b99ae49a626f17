"""The inference lease: while requests are in flight, and for a grace period after, training runs
that allow it hold at their next micro-step, so the server gets the CPU or GPU.

It works across processes through the runs' control folders (requester ``serve``) and SIGUSR1;
each run records its own `held` and `continued` events, and the lease records why.
"""

from __future__ import annotations

import threading
import time
import tomllib

from ..control import ask, read_requests
from ..home import run_dir
from ..ledger import Ledger
from ..runlock import is_locked


class InferenceLease:
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
                policy = tomllib.loads(run["job_toml"]).get("policy", {})
                if policy.get("enabled", True) and policy.get("yield_to_inference", True):
                    found[run["id"]] = float(policy.get("inference_grace_seconds", 3.0))
        return found

    def begin(self) -> None:
        """A request starts: make sure eligible runs are asked to hold."""
        if not self.enabled:
            return
        with self.lock:
            self.inflight += 1
            for run_id, grace in self._eligible().items():
                if run_id not in self.holding:
                    folder = run_dir(run_id)
                    ask(folder, "serve", "hold", "inference requests in flight")
                    self.holding[run_id] = grace

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
        folder = run_dir(run_id)
        if "serve" in read_requests(folder):
            ask(folder, "serve", None)
        del self.holding[run_id]

    def close(self) -> None:
        self._stop.set()
        with self.lock:
            for run_id in list(self.holding):
                self._release(run_id)
