"""Reward functions for GRPO: the built-in ones (builtin.py) and the owner's own, named in the job
file by file and function, all called in a child process (host.py) with a time limit each.

``Rewards`` is what training holds: ``check()`` loads every function once (a missing file or
function, a wrong signature, a module that raises on import: named, before anything is written),
``score()`` calls each on a batch of completions and returns a [completions, functions] table (NaN
where a function returned None: it does not apply there, as in TRL). A function that raises,
returns a non-number, NaN or the wrong number of values, or runs past its ``timeout_seconds`` is a
``RewardError`` naming the function, the step and the prompt's line; the training loop turns it
into a clean stop (errors.StepFailed). Imports no torch: the estimator and light commands read it.
"""

from __future__ import annotations

import hashlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

from ..errors import JobFileError, RewardError

POLL_SECONDS = 0.05  # while waiting on a reward: how often the owner's hold or release is looked at


def file_sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def spec_of(reward, grpo) -> dict[str, Any]:
    """What the host needs of a [[rewards]] table (and its file's sha256, for provenance)."""
    spec = {"kind": reward.kind, "label": reward.label(), "weight": reward.weight, "extract": reward.extract,
            "pattern": reward.pattern, "field": reward.field, "timeout_seconds": reward.timeout_seconds,
            "memory_mb": reward.memory_mb, "processes": reward.processes,
            "max_completion_length": grpo.max_completion_length,
            "target": reward.target or max(grpo.max_completion_length // 2, 1)}
    if reward.kind == "python":
        spec.update(file=str(reward.file), function=reward.function, sha256=file_sha256(reward.file))
    return spec


class RewardHost:
    """The child process and its JSON-lines channel (host.py)."""

    def __init__(self):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "lodger.rewards.host"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, close_fds=True)
        self.buffer = b""

    def ask(self, request: dict, timeout: float, poll: Callable[[], None] | None = None) -> dict | None:
        """The host's answer, or None when it took longer than ``timeout`` seconds (the host is then
        killed). ``poll`` runs every POLL_SECONDS while waiting (a hold there stops the clock; an
        exception from it kills the host and goes up)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill()
                    return None
                if selector.select(min(left, POLL_SECONDS)):
                    chunk = os.read(fd, 1 << 20)
                    if not chunk:
                        raise RewardError(f"the reward process ended unexpectedly (exit status {self.proc.wait()})")
                    self.buffer += chunk
                elif poll is not None:
                    began = time.monotonic()
                    try:
                        poll()
                    except BaseException:
                        self.kill()
                        raise
                    deadline += time.monotonic() - began  # time held is the owner's, not the reward's
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()


LOAD_SECONDS = 120.0  # importing an owner's reward file may import large libraries


class Rewards:
    """The run's reward functions (module docstring). ``poll``: the control's yield point."""

    def __init__(self, configs: Sequence, grpo, poll: Callable[[], None] | None = None):
        self.specs = [spec_of(reward, grpo) for reward in configs]
        self.labels = [spec["label"] for spec in self.specs]
        self.weights = [float(spec["weight"]) for spec in self.specs]
        self.poll = poll
        self.host: RewardHost | None = None

    def provenance(self) -> list[dict]:
        """Each reward as recorded: kind, name, weight, and for the owner's own the file and its sha256."""
        keys = ("kind", "label", "weight", "extract", "pattern", "field", "file", "function", "sha256",
                "timeout_seconds")
        return [{k: spec[k] for k in keys if spec.get(k) is not None} for spec in self.specs]

    def files(self) -> dict[str, str]:
        """{function label: sha256 of its file}, the owner's functions only (drift at resume)."""
        return {spec["label"]: spec["sha256"] for spec in self.specs if "sha256" in spec}

    def _started(self) -> RewardHost:
        if self.host is None or self.host.proc.poll() is not None:
            self.host = RewardHost()
            answer = self.host.ask({"op": "load", "rewards": self.specs}, LOAD_SECONDS)
            if answer is None:
                raise JobFileError(f"[[rewards]]: loading the reward functions took over {LOAD_SECONDS:.0f} s "
                                   "(does a reward file run something at import?)")
            if answer["problems"]:
                self.close()
                listed = "\n".join(f"  - {p}" for p in answer["problems"])
                raise JobFileError(f"{len(answer['problems'])} problem(s) with the reward functions:\n{listed}")
        return self.host

    def check(self) -> None:
        """Load every function once (JobFileError listing each problem); the host is kept."""
        self._started()

    def score(self, prompts: list, completions: list, completion_ids: list[list[int]], fields: dict[str, list],
              lines: list[int], step: int, evaluating: bool = False) -> list[list[float]]:
        """[completion][function] rewards (NaN: the function does not apply there). ``step``: the
        steps finished (what the functions get as `step`); ``evaluating``: an eval after them."""
        table = [[float("nan")] * len(self.specs) for _ in completions]
        for f, spec in enumerate(self.specs):
            request = {"op": "score", "label": spec["label"], "prompts": prompts, "completions": completions,
                       "completion_ids": completion_ids, "fields": fields, "step": step}
            answer = self._started().ask(request, spec["timeout_seconds"], self.poll)
            if answer is None:
                raise RewardError(self._failed(spec, step, evaluating, lines, None, f"took longer than its limit "
                                               f"of {spec['timeout_seconds']:g} s (timeout_seconds)"))
            if "error" in answer:
                raise RewardError(self._failed(spec, step, evaluating, lines, answer.get("at"), answer["error"]))
            for c, value in enumerate(answer["values"]):
                if value is not None:
                    table[c][f] = value
        return table

    @staticmethod
    def _failed(spec: dict, step: int, evaluating: bool, lines: list[int], at: int | None, why: str) -> str:
        where = (f"on the completion of the prompt at line {lines[at]}" if at is not None
                 else f"on the prompts at line{'s' if len(set(lines)) > 1 else ''} "
                      + ", ".join(map(str, sorted(set(lines)))))
        what = f"`{spec['function']}` in {spec['file']}" if spec["kind"] == "python" else f"the {spec['kind']} reward"
        when = f"in the eval after step {step}" if evaluating else f"at step {step + 1}"
        return (f"reward {spec['label']!r} ({what}) failed {when} {where}: {why}. The run stopped at its last "
                "finished step, whose checkpoint is committed: nothing is lost; fix the reward, then resume the run")

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
            self.host = None
