"""The test-only fault hooks themselves: ``:stop`` freezes the process at the named point (a test
can then act at a known moment), and ``LODGER_FAULT_ROUND`` arms a fault in one federated round only."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

SCRIPT = """
import sys
from lodger.faults import fault_point, in_round
for round_no in (1, 2, 3):
    in_round(round_no)
    print("round", round_no, flush=True)
    fault_point("here")
    fault_point("here")
print("done", flush=True)
"""


def _run(env_extra: dict[str, str]) -> subprocess.Popen:
    env = {**os.environ, **env_extra}
    return subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE, text=True)


def _wait_stopped(proc: subprocess.Popen, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED:
            return True
        time.sleep(0.05)  # polling an observed state, bounded
    return False


def test_stop_freezes_at_the_nth_occurrence_of_the_aimed_round_only():
    proc = _run({"LODGER_FAULT": "here@2:stop", "LODGER_FAULT_ROUND": "2"})
    try:
        assert _wait_stopped(proc), "the process never froze"
        proc.kill()
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    # rounds 1 and 2 began; the second occurrence in round 2 froze it (round 1's two did not count)
    assert out.split("\n")[:2] == ["round 1", "round 2"] and "round 3" not in out, out


def test_without_stop_the_fault_is_a_sigkill_and_an_unaimed_round_runs_through():
    killed = _run({"LODGER_FAULT": "here@1", "LODGER_FAULT_ROUND": "3"})
    out, _ = killed.communicate(timeout=60)
    assert killed.returncode == -9 and out.split() == ["round", "1", "round", "2", "round", "3"], (killed.returncode, out)
    clean = _run({"LODGER_FAULT": "elsewhere@1:stop"})
    out, _ = clean.communicate(timeout=60)
    assert clean.returncode == 0 and out.strip().endswith("done"), out
