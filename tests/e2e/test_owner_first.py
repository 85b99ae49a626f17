"""The owner comes first: pause, hold, resume, yield policies, the agent and its queue, limits.

Real `lodger` processes on the tiny model, real signals (SIGUSR1 from `lodger pause`, SIGKILL),
a real agent looking at /proc. Synchronisation is by polling files and the ledger inside bounded
loops; the only sleeps are measurement windows (CPU use over ~2 s) and poll intervals.

Every test cleans up the processes it started (detached runs included): see ``reaper``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import (checkpoint_dirs, describe, eval_losses, final_adapter_bytes, lodger_env, read_metrics,
                     run_dir_of, run_lodger, show, start_lodger, train_records, wait_until, write_job)
from lodger.owner.machine import CLK_TCK, Sampler, process_jiffies
from lodger.owner.control import notify, process_state, run_state, write_request
from lodger.ledger import Ledger
from lodger.owner.runlock import is_locked, lock_pid

# Long enough that the run is still training while the test acts on it (about 20 s of training on
# one thread; 240 steps once ended before a test's sixth CLI call under load), with gradient
# accumulation so a release can land between the two micro-batches of a step, and LoRA dropout so
# a release that failed to put the RNG back would change the losses.
LONG_JOB = dict(steps=480, batch_size=4, grad_accum=2, every_steps=25, keep_last=2, threads=1,
                max_length=64, dropout=0.1, eval_every=None)
NO_POLICY = {"policy": {"enabled": False}}
POLL = 0.02  # seconds between looks at a file: fine-grained, but not a busy loop beside the run
BUSY_LOOP = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


# -- fixtures ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LongBaseline:
    records: list[dict]
    evals: list[tuple[int, float]]
    adapter: bytes


@pytest.fixture(scope="module")
def long_baseline(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, e2e_data) -> LongBaseline:
    """One uninterrupted run of LONG_JOB, in its own home. Policies and limits do not change the
    numbers, so every test's job (whatever its [policy]) compares against this one."""
    folder = tmp_path_factory.mktemp("owner_first_baseline")
    job = write_job(folder / "job.toml", model=tiny_model_dir, train=e2e_data["train"], eval=e2e_data["eval"],
                    name="long", extra=NO_POLICY, **LONG_JOB)
    env = lodger_env(folder / "home")
    result = run_lodger(["run", job, "--quiet"], env)
    assert result.returncode == 0, describe(result)
    run = run_dir_of(result.stdout.split()[1], env)
    records = train_records(run)
    assert [r["step"] for r in records] == list(range(1, LONG_JOB["steps"] + 1))
    return LongBaseline(records, eval_losses(run), final_adapter_bytes(run))


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """This test's environment: its own LODGER_HOME, and an empty power-supply tree so that a real
    battery (on a laptop running the tests) never makes an agent yield."""
    (tmp_path / "no-power-supply").mkdir()
    return lodger_env(None, LODGER_POWER_SUPPLY_DIR=str(tmp_path / "no-power-supply"))


@pytest.fixture
def reaper(lodger_home: Path):
    """Kill, by pid, every process this test left behind: agents, load generators, and detached or
    agent-started runs (found by the lodger home in their environment; only this test uses it)."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    marker = f"LODGER_HOME={lodger_home}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def long_job(path: Path, tiny_model_dir: Path, e2e_data, name: str = "long", steps: int = LONG_JOB["steps"],
             **sections) -> Path:
    extra = {"policy": {"enabled": False}}
    for section, values in sections.items():
        extra[section] = values
    return write_job(path, model=tiny_model_dir, train=e2e_data["train"], eval=e2e_data["eval"], name=name,
                     extra=extra, **{**LONG_JOB, "steps": steps})


# -- helpers ----------------------------------------------------------------------------------------


def lodger(args: list, env: dict[str, str], expect: int = 0, timeout: float = 300) -> subprocess.CompletedProcess:
    result = run_lodger(args, env, timeout=timeout)
    assert result.returncode == expect, describe(result)
    return result


def detach(job: Path, env: dict[str, str]) -> tuple[str, Path]:
    result = lodger(["run", job, "--detach"], env)
    run_id = result.stdout.splitlines()[0].split()[1]
    return run_id, run_dir_of(run_id, env)


def foreground(job: Path, env: dict[str, str], tmp_path: Path, reaper: list) -> tuple[str, Path]:
    """`lodger run JOB` in a terminal of its own (not a managed run): one process fewer than --detach."""
    running = start_lodger(["run", job, "--quiet"], env, log_dir=tmp_path / "proc")
    reaper.append(running.proc)
    run_id = running.run_id()
    folder = run_dir_of(run_id, env)
    wait_until(lambda: is_locked(folder), 120, running.proc, what=f"{run_id} to start", output=running,
               interval=POLL)
    return run_id, folder


def newest_step(folder: Path) -> int:
    steps = [r["step"] for r in read_metrics(folder) if r["kind"] == "train"]
    return max(steps, default=0)


def wait_step(folder: Path, step: int, timeout: float = 120) -> int:
    """Wait until the run has logged ``step`` (or later) while it still holds its lock."""
    def reached():
        newest = newest_step(folder)
        if newest >= step:
            return newest
        assert is_locked(folder) or newest_step(folder) >= step, \
            f"the run stopped at step {newest} before reaching step {step}:\n{log_tail(folder)}"
        return None

    return wait_until(reached, timeout, what=f"step {step} of {folder.name}", interval=POLL)


def wait_state(folder: Path, state: str, by: str | None = None, timeout: float = 60) -> dict:
    def seen():
        current = run_state(folder)
        return current if current.get("state") == state and (by is None or current.get("by") == by) else None

    return wait_until(seen, timeout, what=f"{folder.name} to say {state!r}" + (f" by {by}" if by else ""),
                      interval=POLL)


def wait_unlocked(folder: Path, timeout: float = 60) -> None:
    wait_until(lambda: not is_locked(folder), timeout, what=f"{folder.name} to release its lock", interval=POLL)


def ledger_run(run_id: str) -> dict:
    with Ledger() as ledger:
        return ledger.run(run_id)


def wait_finished(run_id: str, folder: Path, timeout: float = 180) -> None:
    def done():
        status = ledger_run(run_id)["status"]
        assert status not in ("failed", "paused", "interrupted") or is_locked(folder), \
            f"{run_id} ended {status}:\n{log_tail(folder)}"
        return status == "finished" and not is_locked(folder)

    wait_until(done, timeout, what=f"{run_id} to finish", interval=0.1)


def log_tail(folder: Path) -> str:
    parts = []
    for name in ("log.txt", "worker.out"):
        path = folder / name
        if path.exists():
            parts.append(f"--- {name}\n" + path.read_text(errors="replace")[-2500:])
    return "\n".join(parts)


def events(run_id: str, env: dict[str, str]) -> list[dict]:
    return show(run_id, env)["events"]


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of ``pid``, from /proc/<pid>/stat."""
    return process_jiffies(pid) / CLK_TCK


def held_cpu_share(pid: int, window: float = 2.0) -> float:
    """Share of one core that ``pid`` used over ``window`` seconds (a measurement, not a wait)."""
    before, started = cpu_seconds(pid), time.monotonic()
    time.sleep(window)
    return (cpu_seconds(pid) - before) / (time.monotonic() - started)


def assert_same_as(folder: Path, baseline: LongBaseline) -> None:
    records = train_records(folder)
    assert [r["step"] for r in records] == [r["step"] for r in baseline.records], \
        "metrics.jsonl must hold every step exactly once, in order"
    for mine, theirs in zip(records, baseline.records):
        assert mine == theirs, f"step {theirs['step']} differs from the uninterrupted run: {mine} != {theirs}"
    assert eval_losses(folder) == baseline.evals
    assert final_adapter_bytes(folder) == baseline.adapter, "the final adapter differs from the uninterrupted run"


def assert_committed_at(folder: Path, step: int) -> None:
    newest = checkpoint_dirs(folder)[-1]
    assert newest == f"step-{step:08d}", f"newest checkpoint {newest}, expected step {step}"
    assert (folder / "checkpoints" / newest / "MANIFEST.json").is_file()


@contextmanager
def cpu_load(processes: int, seconds: float, reaper: list):
    """``processes`` busy loops in separate processes, each ending by itself after ``seconds``."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(seconds)]) for _ in range(processes)]
    reaper.extend(procs)
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


def start_agent(env: dict[str, str], tmp_path: Path, reaper: list, *extra: str):
    agent = start_lodger(["agent", "--interval", "0.3", "--for-seconds", "240", *extra], env,
                         log_dir=tmp_path / "agent")
    reaper.append(agent.proc)
    wait_until(lambda: "agent running" in agent.stdout(), 60, agent.proc, what="the agent to start",
               output=agent, interval=POLL)
    return agent


def stop_agent(agent) -> None:
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=30) == 0, describe(agent)


def policy_events(run_id: str, env: dict[str, str]) -> list[dict]:
    return [e["data"] for e in events(run_id, env) if e["kind"] == "policy"]


# -- pause and resume, both modes -------------------------------------------------------------------


def test_pause_and_resume_in_both_modes_is_bitwise_equal_and_a_held_run_uses_no_cpu(
        tiny_model_dir, e2e_data, long_baseline, env, reaper, tmp_path):
    job = long_job(tmp_path / "job.toml", tiny_model_dir, e2e_data)
    run_id, folder = detach(job, env)
    segment_steps = 8

    def release() -> int:
        out = lodger(["pause", run_id], env).stdout
        assert "checkpoint committed" in out, out
        assert not is_locked(folder), "`lodger pause` returned while the run still holds its lock"
        run = ledger_run(run_id)
        assert run["status"] == "paused"
        assert_committed_at(folder, run["step"])
        return run["step"]

    def hold() -> int:
        lodger(["pause", run_id, "--hold"], env)
        state = run_state(folder)
        assert state["state"] == "held" and state["by"] == "user", state
        assert is_locked(folder)
        return state["step"]

    # 1. release, then resume in the background
    wait_step(folder, segment_steps)
    step = release()
    lodger(["resume", run_id, "--detach"], env)
    wait_step(folder, step + segment_steps)

    # 2. hold: the process stays, keeps its memory and uses (almost) no CPU
    held_at = hold()
    pid = lock_pid(folder)
    share = held_cpu_share(pid)
    assert share < 0.05, f"a held run used {share:.1%} of a core"
    assert newest_step(folder) == held_at, "a held run kept training"

    # 3. release a held run (the release is answered from inside the hold), resume in the background
    step = release()
    lodger(["resume", run_id, "--detach"], env)
    wait_step(folder, step + segment_steps)

    # 4. two holds, each continued by `lodger resume RUN` (same process)
    for _ in range(2):
        held_at = hold()
        out = lodger(["resume", run_id], env).stdout
        assert "continues" in out, out
        wait_step(folder, held_at + segment_steps)

    wait_finished(run_id, folder)
    assert_same_as(folder, long_baseline)
    segments = {r["segment"] for r in read_metrics(folder) if r["kind"] == "train"}
    assert segments == {0, 1, 2}, f"the run was trained in segments {segments}, expected three processes"
    kinds = [e["kind"] for e in events(run_id, env)]
    for kind, times in (("held", 3), ("continued", 2), ("paused", 2), ("resumed", 2)):
        assert kinds.count(kind) == times, f"{kind!r} appears {kinds.count(kind)} times in {kinds}"


def test_a_pause_during_start_up_holds_the_run_instead_of_killing_it(tiny_model_dir, e2e_data, env, reaper,
                                                                     tmp_path):
    job = long_job(tmp_path / "job.toml", tiny_model_dir, e2e_data)
    running = start_lodger(["run", job, "--quiet"], env, log_dir=tmp_path / "proc")
    reaper.append(running.proc)
    folder = run_dir_of(running.run_id(), env)
    # What `lodger pause RUN --hold --no-wait` does, without its interpreter start-up, so that the
    # request lands while the model is still loading: as soon as the run holds its lock.
    wait_until(lambda: is_locked(folder) and lock_pid(folder), 120, running.proc, what="the run's lock",
               output=running, interval=0.002)
    write_request(folder, "user", "hold", "lodger pause")
    notify(lock_pid(folder))
    wait_until(lambda: run_state(folder).get("state") == "held" or running.proc.poll() is not None, 120,
               what="the run to hold or exit", interval=POLL)
    assert running.proc.poll() is None, f"the run exited without holding: {describe(running)}"
    lodger(["pause", running.run_id()], env)
    assert running.wait(60) == 0, describe(running)


def test_pause_returns_once_the_process_is_gone(tiny_model_dir, e2e_data, env, reaper, tmp_path):
    job = long_job(tmp_path / "job.toml", tiny_model_dir, e2e_data)
    running = start_lodger(["run", job, "--quiet"], env, log_dir=tmp_path / "proc")
    reaper.append(running.proc)
    folder = run_dir_of(running.run_id(), env)
    wait_until(lambda: newest_step(folder) >= 2, 120, running.proc, what="step 2", output=running, interval=POLL)
    out = lodger(["pause", running.run_id()], env).stdout
    assert "memory freed" in out
    still_there = running.proc.poll() is None
    assert running.wait(60) == 0, describe(running)
    assert not still_there, "`lodger pause` said 'memory freed' while the training process was still alive"


def test_pause_of_a_run_stopped_by_sigstop_continues_it_to_hold_or_release_and_answers_in_seconds(
        tiny_model_dir, e2e_data, env, reaper, tmp_path):
    """what Ctrl-Z leaves (a real SIGSTOP to the training process): `lodger pause --hold`, then (stopped
    again) `lodger pause`, each say the run was stopped and that they continued it, and return once
    it holds, then once its checkpoint is committed and the process gone (pause used to wait with no
    answer until its timeout)"""
    job = long_job(tmp_path / "job.toml", tiny_model_dir, e2e_data)
    run_id, folder = foreground(job, env, tmp_path, reaper)
    wait_step(folder, 2)
    pid = lock_pid(folder)
    took = {}
    for args, what in ((["--hold"], "hold (it keeps its memory, uses no CPU)"), ([], "checkpoint and exit")):
        os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: process_state(pid) == "T", 30, what="the run to be stopped", interval=POLL)
        started = time.monotonic()
        out = lodger(["pause", run_id, *args, "--timeout", "120"], env).stdout
        took[what] = time.monotonic() - started
        assert f"run {run_id}: its process {pid} was stopped (Ctrl-Z, or SIGSTOP)" in out, out
        assert f"continued it (SIGCONT to pid {pid}) to {what}" in out, out
    assert "checkpoint committed, memory freed" in out, out
    assert max(took.values()) < 60, f"`lodger pause` of a stopped run took {took}"
    wait_until(lambda: process_state(pid) is None, 60, what="the run's process to end", interval=POLL)
    step = int(checkpoint_dirs(folder)[-1].removeprefix("step-"))
    kinds = [e["kind"] for e in events(run_id, env)]
    assert run_state(folder).get("step") == step and "held" in kinds and kinds[-1] == "paused", (step, kinds)


def test_pause_hold_of_a_run_the_agent_already_holds_returns_at_once(tiny_model_dir, e2e_data, env, reaper,
                                                                     tmp_path):
    job = long_job(tmp_path / "job.toml", tiny_model_dir, e2e_data)
    run_id, folder = foreground(job, env, tmp_path, reaper)
    wait_step(folder, 2)
    write_request(folder, "agent", "hold", "on battery")  # what the agent does when a policy says yield
    notify(lock_pid(folder))
    held = wait_state(folder, "held", by="agent")
    wait_until(lambda: time.time() - held["time"] > 1.5, 10, what="the hold to be a little old", interval=POLL)
    # A timeout far above what answering takes even on a loaded machine (a command that imports
    # neither torch nor ray), so that "returned at once" and "waited out its timeout" stay apart.
    started = time.monotonic()
    result = run_lodger(["pause", run_id, "--hold", "--timeout", "120"], env)
    assert result.returncode == 0, describe(result)
    assert time.monotonic() - started < 60, "`lodger pause --hold` of a held run waited out its timeout"


# -- the agent: yield policies ----------------------------------------------------------------------


def background_foreign_cpu(samples: int = 4, window: float = 0.3) -> float:
    """The largest share of all CPUs used by other processes over a few agent-sized windows."""
    sampler, found = Sampler(), []
    for _ in range(samples):
        time.sleep(window)  # a measurement window
        found.append(sampler.measure(set())["foreign_cpu"])
    return max(found)


# solo: the agent measures the whole machine's CPU load; a test on another worker is load too, and
# it could hide the load generators' end (the run continues only once the machine is quiet).
@pytest.mark.solo
def test_foreign_cpu_load_makes_the_agent_hold_the_run_until_it_stops(tiny_model_dir, e2e_data, env, reaper,
                                                                      tmp_path):
    # Other processes (other test sessions, builds) may already load this machine; the limit sits
    # well above what they use now, and well below what the load generators add (every core busy).
    background = background_foreign_cpu()
    if background > 0.6:
        pytest.skip(f"other processes already use {background:.0%} of the CPUs: a foreign-load limit cannot be "
                    "told apart from them on this machine now")
    limit = round(min(0.85, max(0.5, background + 0.25)), 2)
    job = long_job(tmp_path / "job.toml", tiny_model_dir, e2e_data,
                   policy={"enabled": True, "max_foreign_cpu": limit, "clear_seconds": 1.0,
                           "pause_on_battery": False, "yield_mode": "hold"})
    run_id, folder = foreground(job, env, tmp_path, reaper)
    wait_step(folder, 2)
    agent = start_agent(env, tmp_path, reaper)

    with cpu_load(os.cpu_count() or 2, 60, reaper):
        held = wait_state(folder, "held", by="agent", timeout=30)
        assert "CPUs" in held["reason"], held
    # The load is gone: once it has been clear for clear_seconds, the agent lets the run continue.
    wait_state(folder, "running", timeout=90)
    continued_at = run_state(folder)["step"]
    wait_step(folder, continued_at + 2)
    stop_agent(agent)

    decisions = policy_events(run_id, env)
    holds = [d for d in decisions if d["decision"] == "hold"]
    continues = [d for d in decisions if d["decision"] == "continue"]
    assert holds and continues, decisions
    assert any(d["measured"]["foreign_cpu"] > limit for d in holds), holds
    assert all(d["measured"]["foreign_cpu"] <= limit for d in continues), continues
    kinds = [e["kind"] for e in events(run_id, env)]
    assert "held" in kinds and "continued" in kinds


def test_running_on_battery_makes_the_agent_hold_the_run_until_it_charges(tiny_model_dir, e2e_data, env, reaper,
                                                                          tmp_path):
    # This fake sysfs tree stands in for a battery this machine lacks: the agent reads
    # $LODGER_POWER_SUPPLY_DIR/<supply>/{type,status} exactly as it reads /sys/class/power_supply.
    power = Path(env["LODGER_POWER_SUPPLY_DIR"])
    (power / "BAT0").mkdir()
    (power / "BAT0" / "type").write_text("Battery\n")
    (power / "BAT0" / "status").write_text("Discharging\n")
    job = long_job(tmp_path / "job.toml", tiny_model_dir, e2e_data,
                   policy={"enabled": True, "max_foreign_cpu": 1.0, "pause_on_battery": True,
                           "clear_seconds": 1.0, "yield_mode": "hold"})
    run_id, folder = foreground(job, env, tmp_path, reaper)
    wait_step(folder, 2)
    agent = start_agent(env, tmp_path, reaper)

    held = wait_state(folder, "held", by="agent", timeout=30)
    assert held["reason"] == "on battery"
    assert newest_step(folder) == held["step"]
    (power / "BAT0" / "status").write_text("Charging\n")
    wait_state(folder, "running", timeout=30)
    wait_step(folder, held["step"] + 2)
    stop_agent(agent)

    decisions = policy_events(run_id, env)
    assert [d["decision"] for d in decisions] == ["hold", "continue"], decisions
    assert decisions[0]["reasons"] == ["on battery"] and decisions[0]["measured"]["on_battery"] is True
    assert decisions[1]["measured"]["on_battery"] is False


# -- the agent: restarts and the queue --------------------------------------------------------------


def test_after_sigkill_of_agent_and_run_a_new_agent_resumes_the_run_and_starts_the_queue(
        tiny_model_dir, e2e_data, long_baseline, env, reaper, tmp_path):
    job = long_job(tmp_path / "job.toml", tiny_model_dir, e2e_data)
    queued_job = write_job(tmp_path / "queued.toml", model=tiny_model_dir, train=e2e_data["train"],
                           name="queued", steps=12, every_steps=4, threads=1, extra=NO_POLICY)
    first_agent = start_agent(env, tmp_path, reaper, "--max-concurrent", "2")
    run_id, folder = detach(job, env)
    wait_step(folder, 28)  # past the first checkpoint (step 25): some work is lost and done again

    first_agent.kill(signal.SIGKILL)
    first_agent.wait(30)
    os.kill(lock_pid(folder), signal.SIGKILL)  # a power cut, as far as these two know
    wait_unlocked(folder)
    lost_after = newest_step(folder)
    resume_from = int(checkpoint_dirs(folder)[-1].split("-")[1])
    assert 25 <= resume_from <= lost_after
    out = lodger(["queue", "add", queued_job], env).stdout
    assert out.startswith("queued #1"), out

    second_agent = start_agent(env, tmp_path, reaper, "--max-concurrent", "2")
    wait_finished(run_id, folder)

    def queued_run():
        with Ledger() as ledger:
            row = ledger.db.execute("SELECT state, run_id FROM queue WHERE id=1").fetchone()
        return row["run_id"] if row["state"] == "started" and row["run_id"] else None

    queued_id = wait_until(queued_run, 60, what="the queued job's run", interval=0.1)
    wait_finished(queued_id, run_dir_of(queued_id, env))
    stop_agent(second_agent)

    assert_same_as(folder, long_baseline)
    found = events(run_id, env)
    restarts = [e["data"] for e in found if e["kind"] == "agent_resume"]
    assert len(restarts) == 1 and "gone" in restarts[0]["reason"], restarts
    resumed = [e["data"] for e in found if e["kind"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] == resume_from and resumed[0]["lost_after_step"] == lost_after
    queued = ledger_run(queued_id)
    assert queued["status"] == "finished" and queued["step"] == 12 and queued["managed"] == 1
    assert (run_dir_of(queued_id, env) / "adapter" / "adapter_model.safetensors").is_file()
    status = json.loads(lodger(["status", "--json"], env).stdout)
    assert status["queue"] == [] and status["runs"] == []


# -- limits -----------------------------------------------------------------------------------------


def test_a_memory_ceiling_below_the_runs_needs_ends_in_a_checkpoint_and_exit_code_3(tiny_model_dir, e2e_data,
                                                                                    env, tmp_path):
    job = long_job(tmp_path / "job.toml", tiny_model_dir, e2e_data, limits={"memory_gb": 0.05})
    refused = run_lodger(["run", job, "--quiet"], env)  # the pre-flight estimate already says no
    assert refused.returncode == 2 and "memory_gb" in refused.stderr, describe(refused)
    assert not list((Path(env["LODGER_HOME"]) / "runs").glob("*")), "a refused job left a run folder"
    result = run_lodger(["run", job, "--quiet", "--force"], env)  # forced: the ceiling is enforced while running
    assert result.returncode == 3, describe(result)  # not -9: lodger stopped itself, the kernel did not
    run_id = result.stdout.split()[1]
    assert "memory ceiling 0.05 GiB reached" in result.stderr, result.stderr
    assert "raise [limits] memory_gb" in result.stderr and "checkpoint at step 0 is committed" in result.stderr
    folder = run_dir_of(run_id, env)
    assert_committed_at(folder, 0)
    run = ledger_run(run_id)
    assert run["status"] == "paused"
    paused = [e["data"] for e in events(run_id, env) if e["kind"] == "paused"]
    assert paused and paused[-1]["by"] == "limit" and "memory ceiling" in paused[-1]["reason"]


# -- pause --all, status, and commands that must stay light -----------------------------------------


def torch_imports(args: list[str], env: dict[str, str]) -> tuple[int, subprocess.CompletedProcess]:
    """How many modules with "torch" in their name `lodger ARGS` imports (python -X importtime)."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "lodger.cli.main", *args], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, describe(result)
    return sum("torch" in line for line in result.stderr.splitlines()), result


def test_pause_all_gives_back_every_run_and_status_lists_runs_and_queue(tiny_model_dir, e2e_data, env, reaper,
                                                                        tmp_path):
    # Long enough that neither run can finish while the other starts (on a fast machine the run in
    # the terminal did all 240 steps before the detached one had loaded): both are paused anyway.
    jobs = [long_job(tmp_path / f"{name}.toml", tiny_model_dir, e2e_data, name=name, steps=20_000)
            for name in ("one", "two")]
    # One run in the background (--detach), one in a terminal: --all gives back both kinds.
    detached = start_lodger(["run", jobs[0], "--detach"], env, log_dir=tmp_path / "starts")
    reaper.append(detached.proc)
    in_terminal = start_lodger(["run", jobs[1], "--quiet"], env, log_dir=tmp_path / "starts")
    reaper.append(in_terminal.proc)
    run_ids = [detached.run_id(), in_terminal.run_id()]
    assert detached.wait(300) == 0, describe(detached)
    folders = [run_dir_of(r, env) for r in run_ids]
    wait_until(lambda: is_locked(folders[1]), 120, in_terminal.proc, what="the run in the terminal to start",
               output=in_terminal, interval=POLL)
    for folder in folders:
        wait_step(folder, 2)
    lodger(["queue", "add", jobs[0], "--priority", "3"], env)

    count, result = torch_imports(["status", "--json"], env)
    assert count == 0, "`lodger status` imports torch"
    status = json.loads(result.stdout)
    listed = {r["id"]: r for r in status["runs"]}
    assert set(listed) == set(run_ids) and all(r["status"] == "running" for r in listed.values()), status
    assert [(q["name"], q["priority"]) for q in status["queue"]] == [("one", 3)]

    count, result = torch_imports(["pause", "--all"], env)
    assert count == 0, "`lodger pause` imports torch"
    for run_id, folder in zip(run_ids, folders):
        assert run_id in result.stdout and not is_locked(folder)
        run = ledger_run(run_id)
        assert run["status"] == "paused", run
        assert_committed_at(folder, run["step"])
    assert in_terminal.wait(60) == 0, describe(in_terminal)
    count, result = torch_imports(["ls", "--json"], env)
    assert count == 0, "`lodger ls` imports torch"
    assert {r["status"] for r in json.loads(result.stdout)} == {"paused"}
    status = json.loads(lodger(["status", "--json"], env).stdout)
    assert {r["status"] for r in status["runs"]} == {"paused"}
    assert lodger(["pause", "--all"], env).stdout.strip() == "nothing is training"
