"""Yield policies in isolation: which conditions make a run yield, hours that wrap midnight, which
control request wins, and that one requester never cancels another's hold.

The machine is faked where it matters (measured values are plain dicts, /proc readings are
monkeypatched), so these tests say nothing about the load on the machine running them.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from fakes import FakeSampler, measured

from lodger.owner import machine as machine_module
from lodger.owner.agent import Agent
from lodger.owner.machine import Sampler, on_battery, violations, within_hours
from lodger.config import PolicyConfig
from lodger.config.tomlfile import to_toml
from lodger.owner.control import clear_request, effective, read_requests, write_request
from lodger.home import run_dir
from lodger.ledger import Ledger
from lodger.owner.runlock import RunLock
from lodger.ledger.values import NewRun


def policy(**fields) -> PolicyConfig:
    """A policy that checks nothing unless told to."""
    base = dict(max_foreign_cpu=None, max_foreign_memory=None, max_foreign_gpu_memory=None,
                pause_on_battery=False, allowed_hours=None)
    return PolicyConfig(**{**base, **fields})


def clock(hour: int, minute: int = 0) -> time.struct_time:
    return time.struct_time((2026, 11, 29, hour, minute, 0, 6, 333, -1))


def window_around_now(hours_before: int, hours_after: int) -> str:
    """An "HH:MM-HH:MM" window relative to the local time now (wrapping midnight when it must)."""
    now = time.localtime()
    minute = now.tm_hour * 60 + now.tm_min
    start, end = (minute - hours_before * 60) % 1440, (minute + hours_after * 60) % 1440
    return f"{start // 60:02d}:{start % 60:02d}-{end // 60:02d}:{end % 60:02d}"


# -- violations: one condition at a time ---------------------------------------------------------


def test_a_policy_that_checks_nothing_never_asks_to_yield() -> None:
    loud = measured(foreign_cpu=1.0, foreign_memory=1.0, foreign_gpu_memory=1.0, on_battery=True)
    assert violations(policy(), loud) == []


def test_the_defaults_pass_on_a_quiet_mains_powered_machine() -> None:
    assert violations(PolicyConfig(), measured()) == []


def test_foreign_cpu_above_the_limit_asks_to_yield_and_at_the_limit_does_not() -> None:
    rule = policy(max_foreign_cpu=0.5)
    found = violations(rule, measured(foreign_cpu=0.73))
    assert len(found) == 1 and "73%" in found[0] and "CPU" in found[0] and "50%" in found[0]
    assert violations(rule, measured(foreign_cpu=0.5)) == []
    assert violations(rule, measured(foreign_cpu=0.1)) == []


def test_foreign_memory_above_the_limit_asks_to_yield() -> None:
    rule = policy(max_foreign_memory=0.8)
    found = violations(rule, measured(foreign_memory=0.9))
    assert len(found) == 1 and "memory" in found[0] and "90%" in found[0] and "80%" in found[0]
    assert violations(rule, measured(foreign_memory=0.79)) == []


def test_foreign_gpu_memory_above_the_limit_asks_to_yield() -> None:
    rule = policy(max_foreign_gpu_memory=0.5)
    found = violations(rule, measured(foreign_gpu_memory=0.6))
    assert len(found) == 1 and "GPU memory" in found[0]
    assert violations(rule, measured(foreign_gpu_memory=0.4)) == []


def test_without_a_gpu_the_gpu_limit_is_not_a_reason_to_yield() -> None:
    assert violations(policy(max_foreign_gpu_memory=0.01), measured(foreign_gpu_memory=None)) == []


def test_battery_asks_to_yield_only_when_the_policy_says_so() -> None:
    assert violations(policy(pause_on_battery=True), measured(on_battery=True)) == ["on battery"]
    assert violations(policy(pause_on_battery=True), measured(on_battery=False)) == []
    assert violations(policy(pause_on_battery=False), measured(on_battery=True)) == []


def test_outside_the_allowed_hours_asks_to_yield_and_inside_does_not() -> None:
    # violations() reads the real clock, so the windows are placed around "now", two hours clear of it.
    outside = window_around_now(-2, 4)   # from 2 h ahead to 4 h ahead: now is outside
    inside = window_around_now(2, 2)     # from 2 h ago to 2 h ahead (may wrap midnight): now is inside
    found = violations(policy(allowed_hours=outside), measured(time="now"))
    assert len(found) == 1 and outside in found[0] and "outside allowed hours" in found[0]
    assert violations(policy(allowed_hours=inside), measured()) == []


def test_every_condition_that_is_violated_is_listed() -> None:
    rule = policy(max_foreign_cpu=0.5, max_foreign_memory=0.5, pause_on_battery=True)
    found = violations(rule, measured(foreign_cpu=0.9, foreign_memory=0.9, on_battery=True))
    assert len(found) == 3


# -- within_hours ----------------------------------------------------------------------------------


@pytest.mark.parametrize("hour, minute, expected", [
    (22, 0, True),    # the start is inside
    (23, 59, True),
    (0, 0, True),     # across midnight
    (3, 30, True),
    (6, 59, True),
    (7, 0, False),    # the end is outside
    (12, 0, False),
    (21, 59, False),
])
def test_a_window_that_wraps_midnight_covers_the_night(hour: int, minute: int, expected: bool) -> None:
    assert within_hours("22:00-07:00", clock(hour, minute)) is expected


@pytest.mark.parametrize("hour, minute, expected", [
    (8, 59, False), (9, 0, True), (12, 30, True), (16, 59, True), (17, 0, False), (23, 0, False)])
def test_a_window_within_one_day_covers_only_the_day(hour: int, minute: int, expected: bool) -> None:
    assert within_hours("09:00-17:00", clock(hour, minute)) is expected


# -- control requests ------------------------------------------------------------------------------


def test_no_request_means_run() -> None:
    assert effective({})["state"] == "run"


@pytest.mark.parametrize("order", [("agent", "user", "serve"), ("serve", "user", "agent"), ("user", "agent", "serve")])
def test_the_strongest_request_wins_whoever_asked_first(order: tuple[str, ...]) -> None:
    states = {"agent": "hold", "user": "release", "serve": "run"}
    requests = {who: {"state": states[who], "by": who, "reason": f"{who} says"} for who in order}
    winner = effective(requests)
    assert (winner["state"], winner["by"], winner["reason"]) == ("release", "user", "user says")


def test_a_hold_beats_run(tmp_path: Path) -> None:
    write_request(tmp_path, "serve", "run", "done serving")
    write_request(tmp_path, "agent", "hold", "busy")
    assert effective(read_requests(tmp_path))["by"] == "agent"


def test_a_users_hold_survives_the_agent_clearing_its_own_request(tmp_path: Path) -> None:
    write_request(tmp_path, "agent", "hold", "other processes use 90% of the CPUs")
    write_request(tmp_path, "user", "hold", "lodger pause")
    clear_request(tmp_path, "agent")
    winner = effective(read_requests(tmp_path))
    assert (winner["state"], winner["by"]) == ("hold", "user")


def _live_run(ledger: Ledger, run_id: str, rule: dict) -> RunLock:
    """A run row plus a lock held by this process, so the agent sees a live run (whose pid is ours)."""
    job = {"data": {"train": "train.jsonl"}, "training": {"steps": 10}, "policy": rule}
    ledger.create_run(NewRun(run_id, name="unit", model="m", method="lora", job_hash="0", job_toml=to_toml(job),
                      total_steps=10, pid=None))
    folder = run_dir(run_id)
    folder.mkdir(parents=True)
    return RunLock(folder)


@pytest.fixture
def usr1_count():
    """The agent wakes "the run" (this process) with SIGUSR1; count instead of dying of it."""
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: seen.append(1))
    yield seen
    signal.signal(signal.SIGUSR1, previous)


def test_the_agent_clearing_its_own_hold_leaves_the_users_hold_in_place(lodger_home: Path, usr1_count) -> None:
    with Ledger() as ledger:
        lock = _live_run(ledger, "unit-run", {"max_foreign_cpu": 0.5, "clear_seconds": 0.0, "pause_on_battery": False})
        try:
            agent = Agent(ledger, interval=0.1)
            agent.sampler = fake = FakeSampler()
            folder = run_dir("unit-run")

            fake.values = measured(foreign_cpu=0.9)
            agent.tick()
            assert read_requests(folder)["agent"]["state"] == "hold"
            write_request(folder, "user", "hold", "lodger pause")

            fake.values = measured(foreign_cpu=0.1)
            agent.tick()
            requests = read_requests(folder)
            assert "agent" not in requests
            assert effective(requests)["by"] == "user" and effective(requests)["state"] == "hold"
            decisions = [e["data"]["decision"] for e in ledger.events("unit-run") if e["kind"] == "policy"]
            assert decisions == ["hold", "continue"]
            assert len(usr1_count) == 2  # woken for each decision
        finally:
            lock.release()


def test_the_agent_waits_clear_seconds_before_letting_a_run_continue(lodger_home: Path, usr1_count) -> None:
    with Ledger() as ledger:
        lock = _live_run(ledger, "unit-run", {"max_foreign_cpu": 0.5, "clear_seconds": 3600.0, "pause_on_battery": False})
        try:
            agent = Agent(ledger, interval=0.1)
            agent.sampler = fake = FakeSampler()
            fake.values = measured(foreign_cpu=0.9)
            agent.tick()
            fake.values = measured(foreign_cpu=0.0)
            agent.tick()
            agent.tick()
            assert read_requests(run_dir("unit-run"))["agent"]["state"] == "hold"
        finally:
            lock.release()


def test_a_load_half_way_to_the_limit_makes_the_agent_look_again_within_a_quarter_interval(lodger_home: Path,
                                                                                         usr1_count) -> None:
    with Ledger() as ledger:
        lock = _live_run(ledger, "unit-run", {"max_foreign_cpu": 0.5, "pause_on_battery": False})
        try:
            agent = Agent(ledger, interval=0.1)
            agent.sampler = fake = FakeSampler()
            for foreign, soon in ((0.2, False), (0.3, True), (0.1, False)):
                fake.values = measured(foreign_cpu=foreign)
                agent.look_again_soon = False
                agent.tick()
                assert agent.look_again_soon is soon, foreign
            assert "agent" not in read_requests(run_dir("unit-run"))  # suspicion alone asks nothing
            fake.values = measured(foreign_cpu=0.9)
            agent.look_again_soon = False
            agent.tick()
            assert read_requests(run_dir("unit-run"))["agent"]["state"] == "hold" and not agent.look_again_soon
        finally:
            lock.release()


# -- measuring: battery and CPU --------------------------------------------------------------------


def _supply(base: Path, name: str, kind: str, status: str | None) -> None:
    (base / name).mkdir(parents=True, exist_ok=True)
    (base / name / "type").write_text(kind + "\n")
    if status is not None:
        (base / name / "status").write_text(status + "\n")


def test_a_discharging_battery_means_on_battery(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake sysfs power-supply tree: the machines these tests run on have no battery.
    monkeypatch.setenv("LODGER_POWER_SUPPLY_DIR", str(tmp_path))
    _supply(tmp_path, "AC", "Mains", None)
    _supply(tmp_path, "BAT0", "Battery", "Discharging")
    assert on_battery() is True
    (tmp_path / "BAT0" / "status").write_text("Charging\n")
    assert on_battery() is False
    (tmp_path / "BAT0" / "status").write_text("Full\n")
    assert on_battery() is False


def test_no_power_supply_tree_means_mains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LODGER_POWER_SUPPLY_DIR", str(tmp_path / "missing"))
    assert on_battery() is False


class FakeProc:
    """Cumulative jiffies of the whole machine and of single processes, advanced by the test."""

    def __init__(self) -> None:
        self.busy, self.total = 10_000, 100_000
        self.procs: dict[int, int] = {}

    def advance(self, seconds: float, cores: int, busy_by_pid: dict[int, int], foreign: int = 0) -> None:
        self.total += int(seconds * 100 * cores)
        self.busy += sum(busy_by_pid.values()) + foreign
        for pid, jiffies in busy_by_pid.items():
            self.procs[pid] = self.procs.get(pid, 0) + jiffies


@pytest.fixture
def fake_proc(monkeypatch: pytest.MonkeyPatch) -> FakeProc:
    proc = FakeProc()
    monkeypatch.setattr(machine_module, "_cpu_times", lambda: (proc.busy, proc.total))
    monkeypatch.setattr(machine_module, "process_jiffies", lambda pid: proc.procs.get(pid, 0))
    monkeypatch.setattr(machine_module, "process_rss", lambda pid: 0)
    monkeypatch.setattr(machine_module, "on_battery", lambda: False)
    return proc


def test_a_runs_own_cpu_is_not_foreign(fake_proc: FakeProc) -> None:
    run_pid = 4242
    fake_proc.procs[run_pid] = 500  # it has been training for a while
    sampler = Sampler()
    sampler.measure({run_pid})
    fake_proc.advance(1.0, cores=2, busy_by_pid={run_pid: 100}, foreign=20)
    found = sampler.measure({run_pid})
    assert found["foreign_cpu"] == pytest.approx(0.1)
    assert found["our_cpu"] == pytest.approx(0.5)


def test_a_run_that_appears_between_two_looks_is_not_foreign(fake_proc: FakeProc) -> None:
    sampler = Sampler()
    sampler.measure(set())
    run_pid = 4242  # started after the first look; trains on one of two cores for the whole second
    fake_proc.advance(1.0, cores=2, busy_by_pid={run_pid: 100})
    found = sampler.measure({run_pid})
    assert found["foreign_cpu"] == pytest.approx(0.0)


def test_the_agent_does_not_count_the_workers_it_starts_as_foreign(lodger_home: Path) -> None:
    class Child:
        pid = 31337

        def poll(self):
            return None

    with Ledger() as ledger:
        agent = Agent(ledger, interval=0.1)
        agent.sampler = fake = FakeSampler()
        agent.queue_children[1] = Child()
        ledger.db.execute("INSERT INTO queue (id, name, job_path, job_toml, priority, added, state) "
                          "VALUES (1, 'q', 'q.toml', '', 0, 0, 'started')")
        agent.tick()
        assert Child.pid in fake.seen_pids[-1]
