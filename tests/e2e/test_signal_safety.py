"""Signals go only to the process that took a run's lock, never to a pid a lock file merely names.

A lock file can be empty, garbage, a bare pid written by an older lodger, or name a live process of
the owner's that has nothing to do with the run (a stale pid, reused). In every case `lodger pause`,
`lodger resume`, the agent and the inference lease must leave that process alive (SIGUSR1 kills by
default) and treat the run as not running. The unrelated process is a real `sleep`; the lock is
held for real (by this test process, which is not the process the file names) or not at all.

Each side that could signal runs in a session of its own: the old bug signalled pid 0 (its own
process group), and a regression must fail this test, not kill the test runner's shell. A lock
file holding "-1" is only read here (``holder``), never given to anything that signals: a
regression there would signal every process of the user's.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from lodger.config.tomlfile import to_toml
from lodger.owner.control import read_requests
from lodger.home import run_dir
from lodger.ledger import Ledger
from lodger.ledger.values import NewRun
from lodger.owner.runlock import RunLock, holder, is_locked, lock_pid, process_start

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import LODGER, describe, lodger_env  # noqa: E402

RUN = "signals-20261201-000000-ab12"
# What a lock file may hold; "{victim}" is the pid of the unrelated live process, "{start}" its
# real start time (a record that names it exactly, as a forger or a reused pid would).
LOCK_TEXTS = {
    "empty": "",
    "garbage": "not a pid\x00\xff",
    "pid zero": "0",
    "json pid zero": '{{"pid": 0, "start": "x"}}',
    "bare pid (older lodger)": "{victim}",
    "json, wrong start": '{{"pid": {victim}, "start": "0:0"}}',
    "json, the victim exactly": '{{"pid": {victim}, "start": "{start}"}}',
}

# The agent, one tick with a load its policy yields to and one without, in a child process (the
# sampler tests/fakes.py's: the load is what the test says).
AGENT_TICKS = f"import sys\nsys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n" + """
import json
from fakes import FakeSampler
from lodger.owner.agent import Agent
from lodger.ledger import Ledger

with Ledger() as ledger:
    agent = Agent(ledger, interval=0.1)
    agent.sampler = fake = FakeSampler(foreign_cpu=0.9)
    agent.tick()
    fake.values["foreign_cpu"] = 0.0
    agent.tick()
    seen = [sorted(pids) for pids in fake.seen_pids]
    print(json.dumps({"seen": seen, "started": len(agent.starting) + len(agent.queue_children)}))
"""

# The inference lease: one request, then the grace period, in a child process.
LEASE_REQUEST = """
import json, sys, time
from lodger.serve.lease import InferenceLease

lease = InferenceLease(enabled=True, poll_seconds=0.01)
lease.begin()
asked = sorted(lease.holding)
lease.end()
deadline = time.monotonic() + 60
while lease.holding and time.monotonic() < deadline:
    time.sleep(0.01)  # a short poll inside a bounded wait for the release thread
print(json.dumps({"asked": asked, "still_holding": sorted(lease.holding), "thread": lease.thread.is_alive()}))
lease.close()
"""


@pytest.fixture
def victim():
    """An unrelated live process of the owner's (in a session of its own); killed at the end."""
    proc = subprocess.Popen(["sleep", "1000"], stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _alone(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a command in a new session, so that a signal to "its own group" stays there."""
    return subprocess.run(args, env=lodger_env(), capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)


def _python(code: str) -> dict:
    result = _alone([sys.executable, "-c", code])
    assert result.returncode == 0, describe(result)  # -10 would be a SIGUSR1 to its own group
    return json.loads(result.stdout.strip().splitlines()[-1])


def _run_with_lock(text: str, victim: subprocess.Popen, *, held: bool, policy: dict | None = None,
                   run: str = RUN):
    """A run row with status `running` and a lock file holding ``text``; with ``held`` this test
    process takes the lock (so it is locked, but not by the process the file names)."""
    job = {"data": {"train": "train.jsonl"}, "training": {"steps": 10}, "policy": policy or {}}
    with Ledger() as ledger:
        ledger.create_run(NewRun(run, name="signals", model="m", method="lora", job_hash="0", job_toml=to_toml(job),
                          total_steps=10, pid=None))
        ledger.set_status(run, "running", "started", step=0)
    folder = run_dir(run)
    folder.mkdir(parents=True)
    lock = folder / "lock"
    lock.write_text(text.format(victim=victim.pid, start=process_start(victim.pid)))
    fh = None
    if held:
        fh = open(lock, "rb")
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert is_locked(folder)
    return folder, fh


@dataclass
class Locked:
    """One run of a home holding many: a lock text of LOCK_TEXTS, held by this process or not."""

    case: str
    held: bool
    run: str
    folder: Path
    fh: object


def _runs_with_locks(victim: subprocess.Popen, held: tuple[bool, ...], policy: dict | None = None) -> list[Locked]:
    """One run per lock text and per ``held`` value, side by side in this test's home: a command that
    reads every run (`pause --all`, an agent tick, the lease) meets every case in one process."""
    runs = []
    for n, (case, is_held) in enumerate((c, h) for c in LOCK_TEXTS for h in held):
        run = f"signals-20261201-000000-{n:04x}"
        folder, fh = _run_with_lock(LOCK_TEXTS[case], victim, held=is_held, policy=policy, run=run)
        runs.append(Locked(case, is_held, run, folder, fh))
    return runs


def _release(runs: list[Locked]) -> None:
    for run in runs:
        if run.fh:
            run.fh.close()


def _assert_untouched(victim: subprocess.Popen, folder: Path) -> None:
    assert victim.poll() is None, f"the unrelated process died (exit {victim.returncode})"
    assert holder(folder) is None


BOTH = (False, True)  # lock free, lock held by another process
CASES = pytest.mark.parametrize("case", list(LOCK_TEXTS))


def test_pause_signals_nobody_and_says_the_run_is_not_training(victim, lodger_home):
    runs = _runs_with_locks(victim, BOTH)
    try:
        for run in runs:
            result = _alone([LODGER, "pause", run.run, "--hold", "--no-wait"])
            assert result.returncode == 1 and "is not training now" in result.stderr, (run.case, run.held,
                                                                                       describe(result))
            assert "Traceback" not in result.stderr
        result = _alone([LODGER, "pause", "--all", "--no-wait"])  # one process meets every case
        assert result.returncode == 0 and "nothing is training" in result.stdout, describe(result)
        for run in runs:
            _assert_untouched(victim, run.folder)
            assert "user" not in read_requests(run.folder), (run.case, run.held)  # nobody verifiably trains it
    finally:
        _release(runs)


@CASES
def test_resume_of_a_run_locked_by_an_unverifiable_process_signals_nobody(case, victim, lodger_home):
    folder, fh = _run_with_lock(LOCK_TEXTS[case], victim, held=True)
    try:
        result = _alone([LODGER, "resume", RUN])
        assert result.returncode == 1 and "is not running" in result.stderr, describe(result)
        assert "nothing was signalled" in result.stderr and "Traceback" not in result.stderr
        _assert_untouched(victim, folder)
        assert is_locked(folder)  # and nothing tried to train it beside the lock's holder
    finally:
        fh.close()


def test_the_agent_leaves_an_unverifiable_run_alone(victim, lodger_home):
    runs = _runs_with_locks(victim, BOTH,
                            policy={"max_foreign_cpu": 0.5, "clear_seconds": 0.0, "pause_on_battery": False})
    try:
        ticks = _python(AGENT_TICKS)  # one agent, two ticks over every case
        assert ticks["started"] == 0  # it restarted nothing either
        assert ticks["seen"] and all(victim.pid not in pids for pids in ticks["seen"]), ticks
        with Ledger() as ledger:
            for run in runs:
                policy_events = [e for e in ledger.events(run.run) if e["kind"] == "policy"]
                assert policy_events == [], (run.case, run.held, policy_events)
        for run in runs:
            assert "agent" not in read_requests(run.folder), (run.case, run.held)
            _assert_untouched(victim, run.folder)
    finally:
        _release(runs)


def test_the_inference_lease_holds_and_releases_without_signalling_anybody(victim, lodger_home):
    runs = _runs_with_locks(victim, (True,), policy={"inference_grace_seconds": 0.0})
    try:
        lease = _python(LEASE_REQUEST)  # one request: the lease asks every locked run of the home
        assert lease == {"asked": sorted(r.run for r in runs), "still_holding": [], "thread": True}, lease
        for run in runs:
            assert "serve" not in read_requests(run.folder), run.case  # asked in its file only
            _assert_untouched(victim, run.folder)
    finally:
        _release(runs)


@pytest.mark.parametrize("text", ["-1", "-42", '{"pid": -1, "start": "x"}', '{"pid": 1, "start": "x"}',
                                  '{"pid": "7", "start": "x"}', "[1]", "1e3"])
def test_a_lock_file_naming_a_process_group_or_init_names_nobody(text, tmp_path):
    (tmp_path / "lock").write_text(text)
    with open(tmp_path / "lock", "rb") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert lock_pid(tmp_path) is None and holder(tmp_path) is None


def test_a_real_lock_names_its_taker_and_only_while_it_lives(tmp_path, victim):
    folder = tmp_path / "run"
    folder.mkdir()
    code = ("import sys, time; from pathlib import Path; from lodger.owner.runlock import RunLock; "
            "lock = RunLock(Path(sys.argv[1])); print('locked', flush=True); time.sleep(1000)")
    taker = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert taker.stdout.readline().strip() == "locked"
        record = json.loads((folder / "lock").read_text())
        assert record == {"pid": taker.pid, "start": process_start(taker.pid)}
        assert holder(folder) == taker.pid
        assert oct((folder / "lock").stat().st_mode & 0o777) == oct(0o600)
    finally:
        taker.kill()
        taker.wait(timeout=30)
    assert holder(folder) is None and not is_locked(folder)
    # The dead taker's record, now naming a live process (as a reused pid would): still nobody.
    (folder / "lock").write_text(json.dumps({"pid": victim.pid, "start": process_start(victim.pid)}))
    assert holder(folder) is None
    lock = RunLock(folder)  # a new taker overwrites the record with its own
    try:
        assert holder(folder) == os.getpid()
    finally:
        lock.release()
