"""Preference training keeps the promises: a DPO run that dies mid-checkpoint, is released and held
by its owner and SIGKILLed at a random step resumes to the bits of the uninterrupted run (every
logged number, the adapter), and
its result goes where an SFT run's goes (compare, export read by peft). KTO and ORPO runs train
through the same loop. One baseline DPO run per module; one scenario per heavy test.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest

from fixtures_lib import write_preference_jsonl
from helpers import (checkpoint_dirs, describe, final_adapter_bytes, killed_by_sigkill, lodger_env, read_metrics,
                     run_dir_of, run_lodger, show, start_lodger, wait_for_step, wait_until, write_job)

STEPS = 16
JOB = dict(steps=STEPS, batch_size=4, grad_accum=2, every_steps=4, keep_last=2, threads=1, max_length=64,
           dropout=0.1, eval_every=8)
PREFERENCE_FIELDS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")


def records(folder: Path) -> list[dict]:
    """Every metric line without its clock fields: what must be bitwise equal."""
    clock = {"time", "seconds", "tokens_per_s", "mfu", "segment", "held_seconds"}
    return [{k: v for k, v in r.items() if k not in clock} for r in read_metrics(folder)]


def asked_while_frozen(proc, args: list, env: dict):
    """Run `lodger ARGS` (a pause) against the training process ``proc`` while it is stopped: the
    request is in place before the run takes another step; then let the run go on and answer."""
    import subprocess

    from helpers import LODGER

    request = Path(env["LODGER_HOME"]) / "runs" / args[1] / "control" / "user.json"
    wanted = "hold" if "--hold" in args else "release"
    asked_at = time.time()

    def written():
        try:
            body = json.loads(request.read_text())
        except (OSError, ValueError):
            return None
        return body.get("state") == wanted and body.get("time", 0) >= asked_at or None

    os.kill(proc.proc.pid, signal.SIGSTOP)
    try:
        asking = subprocess.Popen([LODGER, *map(str, args)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        wait_until(written, 60, asking, what=f"the {wanted} request in {request}")
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)
    out, err = asking.communicate(timeout=120)
    return subprocess.CompletedProcess(asking.args, asking.returncode, out, err)


@pytest.fixture(scope="module")
def dpo_job(tmp_path_factory, tiny_model_dir) -> Path:
    folder = tmp_path_factory.mktemp("dpo")
    train = write_preference_jsonl(folder / "pairs.jsonl", 48, 0, "dpo")
    evals = write_preference_jsonl(folder / "pairs_eval.jsonl", 8, 1, "dpo")
    return write_job(folder / "dpo.toml", model=tiny_model_dir, train=train, eval=evals, name="dpo", **JOB,
                     extra={"method": {"objective": "dpo", "beta": 0.2}})


@pytest.fixture(scope="module")
def dpo_baseline(tmp_path_factory, dpo_job) -> dict:
    env = lodger_env(tmp_path_factory.mktemp("dpo_home"))
    result = run_lodger(["run", dpo_job, "--quiet"], env)
    assert result.returncode == 0, describe(result)
    run_id = result.stdout.splitlines()[0].split()[1]
    folder = run_dir_of(run_id, env)
    return {"env": env, "run_id": run_id, "dir": folder, "records": records(folder),
            "adapter": final_adapter_bytes(folder)}


def test_dpo_killed_mid_checkpoint_released_held_and_killed_at_a_random_step_resumes_bitwise(dpo_job, dpo_baseline,
                                                                                              tmp_path):
    base = dpo_baseline["records"]
    train = [r for r in base if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert all(set(PREFERENCE_FIELDS) <= set(r) for r in train), train[0]
    assert {r["step"] for r in base if r["kind"] == "eval"} == {0, 8, 16}
    assert all("eval_reward_accuracy" in r for r in base if r["kind"] == "eval")
    # the run learns the preference: the margin grows
    assert train[-1]["reward_margin"] > train[0]["reward_margin"]

    # 1: death inside the second checkpoint's write (its folder never becomes a checkpoint); in
    # the baseline's home, so that compare finds both runs in one ledger
    env = dpo_baseline["env"]
    died = run_lodger(["run", dpo_job, "--quiet"], {**env, "LODGER_FAULT": "before_rename@2"})
    assert killed_by_sigkill(died.returncode), describe(died)
    run_id = died.stdout.splitlines()[0].split()[1]
    folder = run_dir_of(run_id, env)
    assert checkpoint_dirs(folder) == ["step-00000004"]
    assert (folder / "checkpoints" / "step-00000004" / "reference.safetensors").is_file()
    # 2: resume; the owner takes the machine back (release: checkpoint and exit) after step 5. The
    # run is frozen (SIGSTOP) while `lodger pause` starts, so a 30 ms step cannot outrun it.
    proc = start_lodger(["resume", run_id], env, log_dir=tmp_path)
    try:
        wait_for_step(folder, 5, proc, segment=1)
        released = asked_while_frozen(proc, ["pause", run_id], env)
        assert released.returncode == 0 and "checkpoint committed" in released.stdout, describe(released)
        assert proc.wait() == 0, describe(proc)
    finally:
        proc.close()
    paused_at = show(run_id, env)["run"]["step"]
    assert paused_at < STEPS, paused_at
    # 3: resume; hold (no CPU, memory kept) and continue the same process; SIGKILL at a random step
    seed = int(os.environ.get("LODGER_TEST_SEED") or random.randrange(2**32))
    target = random.Random(seed).randrange(paused_at + 1, STEPS - 1)
    print(f"kill seed {seed}: paused at {paused_at}, SIGKILL at step >= {target}")
    proc = start_lodger(["resume", run_id], env, log_dir=tmp_path)
    try:
        wait_for_step(folder, paused_at + 1, proc, segment=2)
        held = asked_while_frozen(proc, ["pause", run_id, "--hold"], env)
        assert held.returncode == 0, describe(held)
        assert "continues" in run_lodger(["resume", run_id], env, fork=False).stdout
        wait_for_step(folder, target, proc, segment=2)
        proc.kill(signal.SIGKILL)
        assert killed_by_sigkill(proc.wait()), describe(proc)
    finally:
        proc.close()
    finished = run_lodger(["resume", run_id], env)
    assert finished.returncode == 0, describe(finished)

    assert records(folder) == base, "a resumed DPO run logged other numbers than the uninterrupted one"
    assert final_adapter_bytes(folder) == dpo_baseline["adapter"]
    # compare sees the two runs as bitwise equal, preference metrics included
    compared = run_lodger(["compare", run_id, dpo_baseline["run_id"], "--plot", tmp_path / "c.png"], env)
    assert compared.returncode == 0, describe(compared)
    assert "preference metrics" in compared.stdout and "bitwise equal" in compared.stdout, compared.stdout
    assert (tmp_path / "c.png").stat().st_size > 0


def test_dpo_run_shows_its_preference_metrics_and_exports_an_adapter_peft_loads(dpo_baseline, tmp_path):
    env = dpo_baseline["env"]
    shown = run_lodger(["show", dpo_baseline["run_id"]], env)
    assert shown.returncode == 0, describe(shown)
    assert "reward margin" in shown.stdout and "accuracy" in shown.stdout, shown.stdout
    info = show(dpo_baseline["run_id"], env)
    assert info["run"]["status"] == "finished"
    out = tmp_path / "export"
    exported = run_lodger(["export", dpo_baseline["run_id"], out, "--format", "peft"], env)
    assert exported.returncode == 0, describe(exported)
    config = json.loads(next(out.rglob("adapter_config.json")).read_text())
    assert config["peft_type"] == "LORA"


@pytest.mark.parametrize("objective", ["kto", "orpo"])
def test_kto_and_orpo_train_through_the_same_loop(objective, tmp_path, tiny_model_dir):
    train = write_preference_jsonl(tmp_path / "train.jsonl", 16, 0, objective)
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=train, eval_fraction=0.25, name=objective,
                    steps=4, batch_size=4, grad_accum=1, every_steps=2, eval_every=2,
                    extra={"method": {"objective": objective}})
    result = run_lodger(["run", job, "--quiet"])
    assert result.returncode == 0, describe(result)
    folder = run_dir_of(result.stdout.splitlines()[0].split()[1])
    train_lines = [r for r in read_metrics(folder) if r["kind"] == "train"]
    assert [r["step"] for r in train_lines] == [1, 2, 3, 4]
    assert all("reward_accuracy" in r for r in train_lines)
    assert all(("kl" in r) == (objective == "kto") for r in train_lines)
    assert all(("nll" in r) == (objective == "orpo") for r in train_lines)
    has_reference = (folder / "checkpoints" / "step-00000004" / "reference.safetensors").is_file()
    assert has_reference == (objective == "kto")  # ORPO has no reference model
