"""A run stopped by Ctrl-Z cannot answer a pause: control.continue_stopped continues it, and what
the terminal stopped with it (its process group), each by pid; nothing else. Real processes, real
SIGSTOP and SIGCONT.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from lodger.owner.control import continue_stopped, process_state

# A parent in a process group of its own (a shell job), and a child in that group (another rank).
JOB = ("import subprocess, sys, time\n"
       "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
       "print(child.pid, flush=True)\n"
       "time.sleep(120)\n")


def _stopped(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while process_state(pid) != "T":
        assert time.monotonic() < deadline, f"{pid} did not stop"
        time.sleep(0.01)  # polling an observed state inside a bounded wait


@pytest.fixture
def job():
    parent = subprocess.Popen([sys.executable, "-c", JOB], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(parent.stdout.readline())
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    yield parent.pid, child, other.pid
    for proc in (parent, other):
        proc.kill()
        proc.wait(timeout=30)
    try:
        os.kill(child, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_the_stopped_run_and_what_was_stopped_in_its_group_are_continued_and_nothing_else(job):
    """holder and its group's stopped member continue; a stopped process of another group stays stopped"""
    holder, rank, stranger = job
    for pid in job:
        _stopped(pid)
    assert sorted(continue_stopped(holder)) == sorted([holder, rank])
    assert process_state(holder) != "T" and process_state(rank) != "T"
    assert process_state(stranger) == "T"


def test_a_process_that_is_gone_continues_nothing():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)
    assert continue_stopped(gone.pid) == [] and process_state(gone.pid) is None
