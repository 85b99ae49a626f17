"""The agent against bad luck: runs left `created`, runs that keep dying, and errors in a tick.

Real `lodger` and `lodger agent` processes in the test's own LODGER_HOME. A run is left `created`
by killing `lodger run --detach` at the fault point just after the run exists (`after_create_run`):
a crash before the worker ever started. Synchronisation is by polling the ledger and files inside
bounded loops. Every process started here is killed by pid at the end.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import (describe, killed_by_sigkill, lodger_env, read_metrics, run_dir_of, run_lodger,
                     start_lodger, wait_until, write_job)

SMALL = dict(steps=8, batch_size=4, grad_accum=1, every_steps=4, keep_last=2, threads=1, max_length=64,
             dropout=0.0, eval_every=None)


@pytest.fixture
def env(tmp_path: Path, lodger_home: Path) -> dict[str, str]:
    (tmp_path / "no-power-supply").mkdir()  # no battery, whatever machine runs the tests
    return lodger_env(lodger_home, LODGER_POWER_SUPPLY_DIR=str(tmp_path / "no-power-supply"))


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def rows(env: dict, sql: str, *args) -> list[tuple]:
    db = sqlite3.connect(f"file:{Path(env['LODGER_HOME']) / 'ledger.db'}?mode=ro", uri=True)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def run_events(env: dict, run_id: str) -> list[dict]:
    return [{"kind": k, "time": t, "data": json.loads(d)}
            for k, t, d in rows(env, "SELECT kind, time, data FROM events WHERE run_id=? ORDER BY seq", run_id)]


def status_of(env: dict, run_id: str) -> str:
    return rows(env, "SELECT status FROM runs WHERE id=?", run_id)[0][0]


def created_and_abandoned(job: Path, env: dict, *extra: str) -> str:
    """A run whose creator died right after creating it (before any worker took it up)."""
    result = run_lodger(["run", job, *extra], {**env, "LODGER_FAULT": "after_create_run"})
    assert killed_by_sigkill(result.returncode), describe(result)
    ((run_id,),) = rows(env, "SELECT id FROM runs ORDER BY created DESC LIMIT 1")
    assert status_of(env, run_id) == "created"
    return run_id


def start_agent(env: dict, tmp_path: Path, procs: list, *extra: str):
    agent = start_lodger(["agent", "--interval", "0.2", "--for-seconds", "300", *extra], env,
                         log_dir=tmp_path / "agent")
    procs.append(agent.proc)
    wait_until(lambda: "agent running" in agent.stdout(), 60, agent.proc, what="the agent to start", output=agent)
    return agent


def stop_agent(agent) -> None:
    assert agent.proc.poll() is None, "the agent ended by itself: " + describe(agent)
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=60) == 0, describe(agent)


def test_a_managed_run_left_created_is_started_by_the_agent_and_finishes(tiny_model_dir, e2e_data, env,
                                                                       tmp_path, procs):
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=e2e_data["train"], name="orphan",
                    extra={"policy": {"enabled": False}}, **SMALL)
    run_id = created_and_abandoned(job, env, "--detach")
    agent = start_agent(env, tmp_path, procs)
    wait_until(lambda: status_of(env, run_id) in ("finished", "failed", "gave_up"), 240, agent.proc,
               what=f"{run_id} to finish", output=agent, interval=0.1)
    stop_agent(agent)
    assert status_of(env, run_id) == "finished", (run_dir_of(run_id, env) / "worker.out").read_text()
    kinds = [e["kind"] for e in run_events(env, run_id)]
    restarts = [e["data"] for e in run_events(env, run_id) if e["kind"] == "agent_resume"]
    assert len(restarts) == 1 and "created but never started" in restarts[0]["reason"], restarts
    assert "started" in kinds and "resumed" not in kinds, kinds  # a fresh start, segment 0
    steps = [r["step"] for r in read_metrics(run_dir_of(run_id, env)) if r["kind"] == "train"]
    assert steps == list(range(1, SMALL["steps"] + 1))


def test_a_run_that_keeps_failing_is_retried_with_growing_delays_then_given_up(tiny_model_dir, e2e_data, env,
                                                                              tmp_path, procs):
    train = tmp_path / "train.jsonl"
    original = Path(e2e_data["train"]).read_bytes()
    train.write_bytes(original)
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=train, name="doomed",
                    extra={"policy": {"enabled": False}}, **SMALL)
    run_id = created_and_abandoned(job, env, "--detach")
    train.unlink()  # every try now fails before training: its data is gone
    agent = start_agent(env, tmp_path, procs, "--retry-delay", "0.5", "--max-tries", "3")
    wait_until(lambda: status_of(env, run_id) == "gave_up", 240, agent.proc, what=f"the agent to give up {run_id}",
               output=agent, interval=0.1)
    status = run_lodger(["status", "--json"], env)
    assert status.returncode == 0, describe(status)
    listed = {r["id"]: r for r in json.loads(status.stdout)["runs"]}
    assert listed[run_id]["status"] == "gave_up", listed
    text = run_lodger(["status"], env).stdout
    assert any(line.startswith("gave_up") and run_id in line for line in text.splitlines()), text
    stop_agent(agent)  # still alive after all that

    found = [e for e in run_events(env, run_id) if e["kind"] in ("agent_resume", "restart_delayed", "gave_up")]
    assert [e["kind"] for e in found] == ["agent_resume", "restart_delayed", "agent_resume", "restart_delayed",
                                          "agent_resume", "gave_up"], found
    delays = [e["data"]["delay_seconds"] for e in found if e["kind"] == "restart_delayed"]
    assert delays == [0.5, 1.0]
    for wait, next_try in ((found[1], found[2]), (found[3], found[4])):
        assert next_try["time"] - wait["time"] >= wait["data"]["delay_seconds"], (wait, next_try)
    assert found[-1]["data"]["failed_tries"] == 3
    assert "train.jsonl" in (run_dir_of(run_id, env) / "worker.out").read_text()

    train.write_bytes(original)  # the owner fixes the cause; `lodger resume` is how a given-up run goes on
    resumed = run_lodger(["resume", run_id, "--quiet"], env)
    assert resumed.returncode == 0, describe(resumed)
    assert status_of(env, run_id) == "finished"


# The stand-in takes the lock as a training process does (lodger's RunLock records its pid and
# start time), so the agent can verify it is the run's holder; an unverifiable lock is left alone.
LOCK_HOLDER = """
import signal, sys
from pathlib import Path
from lodger.owner.runlock import RunLock
signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the agent wakes the run it holds; this stand-in ignores it
lock = RunLock(Path(sys.argv[1]).parent)
print("locked", flush=True)
sys.stdin.read()
"""


def hours_not_now() -> str:
    """An allowed-hours window that does not hold the local time now (it starts in two hours)."""
    now = time.localtime()
    start = (now.tm_hour * 60 + now.tm_min + 120) % 1440
    end = (start + 60) % 1440
    return f"{start // 60:02d}:{start % 60:02d}-{end // 60:02d}:{end % 60:02d}"


def hold_lock(folder: Path, procs: list) -> None:
    """Make the run look live to the agent: a stand-in process holds its lock."""
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(folder / "lock")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    procs.append(holder)
    assert holder.stdout.readline().strip() == "locked"


def policy_decisions(env: dict, run_id: str) -> list[dict]:
    return [e["data"] for e in run_events(env, run_id) if e["kind"] == "policy"]


def test_an_unreadable_run_is_logged_and_the_agent_goes_on_with_the_others(tiny_model_dir, e2e_data, env,
                                                                           tmp_path, procs):
    policy = {"enabled": True, "allowed_hours": hours_not_now(), "max_foreign_cpu": 1.0, "pause_on_battery": False,
              "yield_mode": "hold"}  # says "hold" whatever the load: outside the allowed hours
    ids = {}
    for name in ("bad", "good"):  # not managed: the agent only applies their policies
        job = write_job(tmp_path / f"{name}.toml", model=tiny_model_dir, train=e2e_data["train"], name=name,
                        extra={"policy": policy}, **SMALL)
        ids[name] = created_and_abandoned(job, env)
        hold_lock(run_dir_of(ids[name], env), procs)
    bad = ids["bad"]
    (good_toml,) = rows(env, "SELECT job_toml FROM runs WHERE id=?", bad)[0]
    log = Path(env["LODGER_HOME"]) / "agent.log"
    db = sqlite3.connect(Path(env["LODGER_HOME"]) / "ledger.db")
    try:
        with db:  # a recorded job that cannot be read: its policy fails at every tick
            db.execute("UPDATE runs SET job_toml=? WHERE id=?", ("[policy\nnot toml", bad))
        agent = start_agent(env, tmp_path, procs)
        wait_until(lambda: log.exists() and "Traceback" in log.read_text(), 60, agent.proc,
                   what="a logged traceback", output=agent, interval=0.05)
        wait_until(lambda: policy_decisions(env, ids["good"]), 60, agent.proc, what="the other run's policy",
                   output=agent, interval=0.05)
        assert policy_decisions(env, bad) == []
        with db:
            db.execute("UPDATE runs SET job_toml=? WHERE id=?", (good_toml, bad))
    finally:
        db.close()
    wait_until(lambda: policy_decisions(env, bad), 60, agent.proc,
               what="the agent to apply the run's policy once it could read it", output=agent, interval=0.05)
    stop_agent(agent)
    for run_id in ids.values():
        decision = policy_decisions(env, run_id)[0]
        assert decision["decision"] == "hold" and any("allowed hours" in r for r in decision["reasons"]), decision
    text = log.read_text()
    assert f"error in run {bad}" in text and "TOMLDecodeError" in text, text
    assert text.count("Traceback") == 1, "the same error at every tick is logged once, not once per tick"
    assert "going on" in agent.stderr(), describe(agent)
    errors = [json.loads(d) for (d,) in rows(env, "SELECT data FROM events WHERE kind='agent_error'")]
    assert len(errors) == 1 and "TOMLDecodeError" in errors[0]["error"], errors  # once, not once per tick
