"""Faults: the same command twice at once. Exactly one wins, the other says why, nothing is corrupted.

Races are made exact, not hoped for: a process is frozen at a named point (``LODGER_FAULT=name:stop``:
``before_take_run`` is after a command's checks and before it takes the run's lock;
``after_create_run`` is after `lodger run` made the run and before it trains it;
``checkpoint_before_ledger`` is inside training, the lock held), the rival runs, the first is let go.

- four resumes of one killed run: one trains (frozen while it holds the lock); one asked then is told
  the run is training; one that checked before the lock was taken is refused by the lock; one that
  checked before the run finished does nothing once it has. The run ends bitwise equal to the
  uninterrupted baseline, the ledger audits clean.
- `lodger run` frozen after creating its run, `lodger resume` of that run meanwhile: the resume trains
  it; the `run` process, let go, does nothing (it used to train the finished run again, and crash).
- two agents of one home: the second refuses, naming the first, which goes on.
(Two `serve` of one run: tests/e2e/test_faults_serve.py.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from faults_helpers import assert_audit_clean, cont, wait_stopped
from helpers import (describe, eval_losses, final_adapter_bytes, killed_by_sigkill, lodger_env, run_lodger, show,
                     start_lodger, train_records, wait_until)

pytestmark = pytest.mark.faults


def _frozen(args, home: Path, fault: str, logs: Path):
    proc = start_lodger(args, lodger_env(home, LODGER_FAULT=fault), logs)
    wait_stopped(proc.proc.pid)
    return proc


def _finish(proc, timeout: float = 300) -> int:
    cont(proc.proc.pid)
    return proc.wait(timeout=timeout)


def assert_bitwise_equal(folder: Path, baseline) -> None:
    """Every step's record, every eval loss and the final adapter's bytes as the uninterrupted run's."""
    assert train_records(folder) == baseline.records
    assert eval_losses(folder) == baseline.evals and baseline.evals, (eval_losses(folder), baseline.evals)
    assert final_adapter_bytes(folder) == baseline.adapter, "the final adapter differs from the uninterrupted run's"


@pytest.fixture(scope="module")
def resumes(_killed_home, tmp_path_factory):
    """The story of four resumes of one killed run (see the module's docstring)."""
    src, run_id = _killed_home
    root = tmp_path_factory.mktemp("four_resumes")
    home, logs = root / "home", root / "logs"
    shutil.copytree(src, home)
    env = lodger_env(home)
    procs = []
    try:
        late = _frozen(["resume", run_id], home, "before_take_run:stop", logs)        # checks now, resumes last
        racing = _frozen(["resume", run_id], home, "before_take_run:stop", logs)      # checks now, takes next
        procs += [late, racing]
        winner = _frozen(["resume", run_id], home, "checkpoint_before_ledger@1:stop", logs)  # holds the lock
        procs.append(winner)
        asked = run_lodger(["resume", run_id], env)                                  # asks while it trains
        racing_code = _finish(racing)
        winner_code = _finish(winner)
        late_code = _finish(late)
        out = {"run_id": run_id, "home": home, "env": env, "asked": asked, "racing": (racing, racing_code),
               "winner": (winner, winner_code), "late": (late, late_code)}
        yield out
    finally:
        for proc in procs:
            proc.close()


def test_a_resume_while_another_trains_says_the_run_is_training(resumes):
    """the second resume: non-zero, `is training ... now; nothing to resume`, no traceback"""
    asked = resumes["asked"]
    assert asked.returncode == 1 and "Traceback" not in asked.stderr, describe(asked)
    said = asked.stderr
    assert f"run {resumes['run_id']} is training" in said and "nothing to resume" in said, describe(asked)


def test_a_resume_that_checked_before_another_took_the_run_is_refused_by_the_lock(resumes):
    """refused by the run's lock, naming the pid that trains it"""
    racing, code = resumes["racing"]
    winner = resumes["winner"][0]
    assert code == 1 and "Traceback" not in racing.stderr(), describe(racing)
    assert f"is already running (pid {winner.proc.pid})" in racing.stderr(), describe(racing)


def test_a_resume_that_checked_before_another_finished_the_run_does_nothing(resumes):
    """the last resume, let go after the run finished: `finished by another process meanwhile`, nothing done"""
    late, code = resumes["late"]
    assert code == 1 and "Traceback" not in late.stderr(), describe(late)
    assert "was finished by another process meanwhile (it is finished); this one did nothing" in late.stderr(), \
        describe(late)
    kinds = [e["kind"] for e in show(resumes["run_id"], resumes["env"])["events"]]
    assert kinds.count("finished") == 1 and kinds[-1] == "finished", kinds


def test_the_one_resume_that_won_finishes_bitwise_equal_and_the_ledger_audits_clean(resumes, baseline):
    """the winner exits 0; its records, eval losses and adapter bytes equal the uninterrupted run's; audit clean"""
    winner, code = resumes["winner"]
    assert code == 0, describe(winner)
    assert_bitwise_equal(resumes["home"] / "runs" / resumes["run_id"], baseline)
    assert_audit_clean(resumes["home"])


def test_run_and_resume_racing_one_trains_and_the_other_does_nothing(standard_job, baseline, tmp_path):
    """`run` frozen after creating its run; `resume` trains it; `run`, let go, says so and does nothing"""
    home, logs = tmp_path / "home", tmp_path / "logs"
    home.mkdir(mode=0o700)
    env = lodger_env(home)
    starter = _frozen(["run", standard_job, "--quiet"], home, "after_create_run:stop", logs)
    try:
        run_id = starter.stdout().split()[1] if starter.stdout().strip() else \
            next(p.name for p in (home / "runs").iterdir())
        resumed = run_lodger(["resume", run_id, "--quiet"], env)
        assert resumed.returncode == 0, describe(resumed)
        code = _finish(starter)
    finally:
        starter.close()
    assert code == 1 and "Traceback" not in starter.stderr(), describe(starter)
    assert f"run {run_id} was started by another process meanwhile (it is finished); this one did nothing" \
        in starter.stderr(), describe(starter)
    info = show(run_id, env)
    assert info["run"]["status"] == "finished"
    assert [e["kind"] for e in info["events"]].count("started") + \
        [e["kind"] for e in info["events"]].count("resumed") == 1
    assert_bitwise_equal(home / "runs" / run_id, baseline)
    assert_audit_clean(home)


def test_a_second_agent_is_refused_naming_the_first_which_goes_on(tmp_path):
    """two `lodger agent` on one home: the second exits non-zero naming the first's pid; the first lives"""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (tmp_path / "no-power-supply").mkdir()
    env = lodger_env(home, LODGER_POWER_SUPPLY_DIR=str(tmp_path / "no-power-supply"))
    first = start_lodger(["agent", "--interval", "0.2", "--for-seconds", "300"], env, tmp_path / "logs")
    try:
        from lodger.owner.runlock import flock_held

        wait_until(lambda: flock_held(home / "agent.lock"), 120, first.proc, what="the first agent's lock",
                   output=first, interval=0.05)
        second = run_lodger(["agent", "--interval", "0.2", "--for-seconds", "5"], env)
        assert second.returncode != 0 and "Traceback" not in second.stderr, describe(second)
        assert f"an agent is already running (pid {first.proc.pid})" in second.stderr, describe(second)
        assert first.proc.poll() is None, describe(first)
    finally:
        first.kill(15)
        first.wait(timeout=60)
        first.close()
    assert not killed_by_sigkill(first.proc.returncode)
