"""The owner comes first during an eval too: a hold waits inside it, a release abandons it.

The eval set is large (thousands of examples, hundreds of batches) so that each eval runs long
enough for the test to act while it is under way; the test sees an eval start in log.txt, asks,
and checks that the answer came before that eval's result was recorded. After the release the
run resumes, evaluates again, and must be bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures_lib import write_chat_jsonl
from helpers import (checkpoint_dirs, describe, eval_losses, final_adapter_bytes, killed_by_sigkill, lodger_env,
                     read_metrics, run_dir_of, run_lodger, start_lodger, train_records, wait_until, write_job)
from lodger.owner.control import clear_request, notify, run_state, write_request
from lodger.owner.runlock import is_locked, lock_pid

EVAL_EXAMPLES = 3000  # 750 batches of 4: several seconds of eval even on a fast machine
JOB = dict(steps=8, batch_size=4, grad_accum=2, every_steps=4, keep_last=2, threads=1, max_length=64,
           dropout=0.1, eval_every=4)
POLL = 0.005


@pytest.fixture(scope="module")
def eval_job(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, e2e_data) -> Path:
    folder = tmp_path_factory.mktemp("eval_yield")
    big_eval = write_chat_jsonl(folder / "eval.jsonl", EVAL_EXAMPLES, seed=1)
    return write_job(folder / "job.toml", model=tiny_model_dir, train=e2e_data["train"], eval=big_eval,
                     name="evalyield", extra={"policy": {"enabled": False}}, **JOB)


@pytest.fixture(scope="module")
def eval_baseline(tmp_path_factory: pytest.TempPathFactory, eval_job: Path) -> dict:
    env = lodger_env(tmp_path_factory.mktemp("eval_yield_baseline"))
    result = run_lodger(["run", eval_job, "--quiet"], env)
    assert result.returncode == 0, describe(result)
    folder = run_dir_of(result.stdout.split()[1], env)
    assert [s for s, _ in eval_losses(folder)] == [0, 4, 8]
    return {"records": train_records(folder), "evals": eval_losses(folder), "adapter": final_adapter_bytes(folder)}


def log_has(folder: Path, text: str, times: int = 1) -> bool:
    path = folder / "log.txt"
    return path.exists() and path.read_text(errors="replace").count(text) >= times


def evals_at(folder: Path, step: int) -> list[dict]:
    return [r for r in read_metrics(folder) if r["kind"] == "eval" and r["step"] == step]


def ask(folder: Path, state: str) -> None:
    """What `lodger pause` does, without its interpreter start-up: a request file, then SIGUSR1."""
    write_request(folder, "user", state, "test: during an eval")
    notify(lock_pid(folder))


def wait_eval_started(folder: Path, step: int, running, times: int = 1) -> None:
    """Until the log says the eval at ``step`` started (``times``: the how-manieth time it did)."""
    wait_until(lambda: is_locked(folder) and log_has(folder, f"eval at step {step}: {EVAL_EXAMPLES} examples", times),
               300, running.proc, what=f"the eval at step {step} to start", output=running, interval=POLL)


def test_hold_and_release_during_an_eval_are_answered_inside_it_and_the_run_stays_exact(
        eval_job, eval_baseline, lodger_home, tmp_path):
    env = lodger_env(lodger_home)
    running = start_lodger(["run", eval_job, "--quiet"], env, log_dir=tmp_path)
    try:
        run_id = running.run_id()
        folder = run_dir_of(run_id, env)

        # 1. a hold during the first eval (step 0): held before the eval's result exists
        wait_eval_started(folder, 0, running)
        ask(folder, "hold")
        wait_until(lambda: run_state(folder).get("state") == "held", 120, running.proc,
                   what="the run to hold", output=running, interval=POLL)
        assert evals_at(folder, 0) == [], "the hold was answered only after the eval had finished"
        clear_request(folder, "user")
        notify(lock_pid(folder))

        # 2. a release during the eval at step 4: the process exits without that eval's result,
        #    with the checkpoint of step 4 committed
        wait_eval_started(folder, 4, running)
        ask(folder, "release")
        assert running.wait(120) == 0, describe(running)
        assert evals_at(folder, 4) == [], "the release was answered only after the eval had finished"
        assert len(evals_at(folder, 0)) == 1
        assert checkpoint_dirs(folder)[-1] == "step-00000004"
        assert json.loads(run_lodger(["show", run_id, "--json"], env).stdout)["run"]["status"] == "paused"
    finally:
        running.close()

    # 3. resume: the abandoned eval runs again; SIGKILL during the eval at step 8, before the next
    #    checkpoint: the checkpoint of step 4 still has no result for the eval at step 4 that the
    #    metrics now hold, so the next resume drops that line and runs the eval again (kept, the run
    #    would log it twice)
    resumed = start_lodger(["resume", run_id, "--quiet"], env, log_dir=tmp_path)
    try:
        wait_eval_started(folder, 8, resumed)
        assert len(evals_at(folder, 4)) == 1, "the abandoned eval at step 4 was not run again on resume"
        resumed.kill()
        assert killed_by_sigkill(resumed.wait(120)), describe(resumed)
        assert checkpoint_dirs(folder)[-1] == "step-00000004"
    finally:
        resumed.close()

    # 4. resume again; release during the final eval (step 8), this process's (the log has the killed one's)
    resumed = start_lodger(["resume", run_id, "--quiet"], env, log_dir=tmp_path)
    try:
        wait_eval_started(folder, 8, resumed, times=2)
        assert len(evals_at(folder, 4)) == 1, "the eval at step 4 is logged twice, or not again"
        ask(folder, "release")
        assert resumed.wait(120) == 0, describe(resumed)
        assert evals_at(folder, 8) == []
        assert checkpoint_dirs(folder)[-1] == "step-00000008"
    finally:
        resumed.close()

    # 5. the last resume only evaluates and finishes; everything equals the uninterrupted run
    result = run_lodger(["resume", run_id, "--quiet"], env)
    assert result.returncode == 0, describe(result)
    info = json.loads(run_lodger(["show", run_id, "--json"], env).stdout)
    assert info["run"]["status"] == "finished"
    assert train_records(folder) == eval_baseline["records"]
    assert eval_losses(folder) == eval_baseline["evals"], "each eval once, with the uninterrupted run's numbers"
    assert final_adapter_bytes(folder) == eval_baseline["adapter"]
    assert [e["kind"] for e in info["events"]].count("held") == 1


def test_sigterm_while_starting_stops_before_any_step(tiny_model_dir, e2e_data, lodger_home, tmp_path):
    import os
    import signal

    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=e2e_data["train"], name="early",
                    steps=50, every_steps=10, eval_every=None)
    env = lodger_env(lodger_home)
    running = start_lodger(["run", job, "--quiet"], env, log_dir=tmp_path)
    try:
        folder = run_dir_of(running.run_id(), env)
        wait_until(lambda: is_locked(folder) and lock_pid(folder), 120, running.proc, what="the run's lock",
                   output=running, interval=0.002)
        os.kill(running.proc.pid, signal.SIGTERM)  # while the model loads: no step has run yet
        assert running.wait(120) == 0, describe(running)
    finally:
        running.close()
    info = json.loads(run_lodger(["show", running.run_id(), "--json"], env).stdout)
    assert info["run"]["status"] == "interrupted", info["run"]
    trained = [r["step"] for r in read_metrics(folder) if r["kind"] == "train"]
    assert trained == [], f"a stop asked for during start-up trained on: {trained}"
