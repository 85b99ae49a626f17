"""Test-only fault injection, in one place. Production code reaches it through ``fault_point``
(``durable.fault_point`` is this function) and, in the training step, ``loss_factor``.

- ``LODGER_FAULT=name`` or ``name@N``: ``fault_point(name)`` kills the process with SIGKILL at that
  place (its N-th occurrence, 1-based). The names are listed where they are used
  (recovery.LEDGER_FAULT_POINTS, checkpoint.py, lifecycle/run.py, durable.py, data/registry.py, export/,
  cli/agent.py, cli/serve.py). ``name@N:stop`` freezes the
  process there with SIGSTOP instead, so a test can kill it (or what started it) at a known point,
  not a raced one; it freezes once, at the N-th occurrence only: a process continued with SIGCONT
  goes on past later occurrences.
- ``LODGER_FAULT_ROUND=R``: the fault is armed only while a federated client trains round R
  (``in_round``), so one SuperNode's env can aim at one round of several.
- ``LODGER_TEST_POISON_LINES=3,7``: a micro-batch holding one of these training-file lines gets
  its loss multiplied by Inf (the non-finite guard's end-to-end tests).
Both read the environment only; with neither set they cost a dictionary lookup.
"""

from __future__ import annotations

import math
import os
import signal

FAULT_ENV = "LODGER_FAULT"
ROUND_ENV = "LODGER_FAULT_ROUND"
POISON_ENV = "LODGER_TEST_POISON_LINES"
_fault_counts: dict[str, int] = {}
_round: list[int] = []


def in_round(round_no: int) -> None:
    """A federated client says which round it trains now (for $LODGER_FAULT_ROUND)."""
    _round[:] = [round_no]


def fault_point(name: str) -> None:
    """Die here, now, with SIGKILL (or freeze, with ``:stop``) if the test harness asked for it
    through $LODGER_FAULT."""
    wanted = os.environ.get(FAULT_ENV)
    if not wanted:
        return
    wanted, _, action = wanted.partition(":")
    target, _, nth = wanted.partition("@")
    if target != name:
        return
    aimed = os.environ.get(ROUND_ENV)
    if aimed and _round != [int(aimed)]:
        return
    _fault_counts[name] = _fault_counts.get(name, 0) + 1
    if _fault_counts[name] == int(nth or 1):  # SIGKILL ends the process here; SIGSTOP fires only this once
        os.kill(os.getpid(), signal.SIGSTOP if action == "stop" else signal.SIGKILL)


def poisoned_lines() -> frozenset[int]:
    return frozenset(int(x) for x in os.environ.get(POISON_ENV, "").split(",") if x.strip())


def loss_factor(lines: list[int], poisoned: frozenset[int]) -> float:
    """Inf when a micro-batch holds a poisoned line, else 1."""
    return math.inf if poisoned and any(line in poisoned for line in lines) else 1.0
