"""GRPO keeps the promises: a run that dies mid-checkpoint, is paused by its owner in the middle of
generating completions, and is SIGKILLed in the middle of generation at a random decode step,
resumes to the bits of the uninterrupted run: every completion's reward, advantage statistics,
loss and eval sample, and the adapter. With num_iterations = 2 and a KL term, so the kept
completions (with their log-probabilities at sampling time) and the reference pass are part of
what must come back. A reward that fails stops the run at a clean checkpoint; fixed, the run
resumes and finishes, the change recorded as drift. One baseline per module; one scenario per
heavy test.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from fixtures_lib import VOWEL_REWARD, write_prompt_jsonl
from helpers import (checkpoint_dirs, describe, event_kinds, final_adapter_bytes, killed_by_sigkill, lodger_env,
                     read_metrics, run_dir_of, run_lodger, show, start_lodger, wait_until, write_job)
from test_preference import asked_while_frozen, records

STEPS, MU, G, LENGTH, BATCH = 8, 2, 4, 8, 2
# decode steps a step takes: one sampling (every MU steps) of BATCH prompts, at most LENGTH each
DECODES_PER_SAMPLING = LENGTH
JOB = dict(steps=STEPS, batch_size=BATCH, grad_accum=1, every_steps=3, keep_last=2, threads=1, max_length=64,
           dropout=0.0, eval_every=4, learning_rate=2e-2)
GRPO = {"num_generations": G, "max_completion_length": LENGTH, "num_iterations": MU, "beta": 0.05,
        "eval_samples": 2}


def grpo_job(folder: Path, model: Path, reward_file: Path) -> Path:
    train = write_prompt_jsonl(folder / "prompts.jsonl", 24, 0)
    evals = write_prompt_jsonl(folder / "prompts_eval.jsonl", 4, 1)
    return write_job(folder / "grpo.toml", model=model, train=train, eval=evals, name="grpo", **JOB,
                     extra={"method": {"objective": "grpo"}, "grpo": GRPO},
                     tables={"rewards": [{"kind": "python", "file": str(reward_file), "function": "vowels"},
                                         {"kind": "answer", "weight": 0.5}]})


@pytest.fixture(scope="module")
def grpo_baseline(tmp_path_factory, tiny_model_dir) -> dict:
    folder = tmp_path_factory.mktemp("grpo")
    reward = folder / "rewards.py"
    reward.write_text(VOWEL_REWARD)
    job = grpo_job(folder, tiny_model_dir, reward)
    env = lodger_env(tmp_path_factory.mktemp("grpo_home"))
    result = run_lodger(["run", job, "--quiet"], env)
    assert result.returncode == 0, describe(result)
    run_id = result.stdout.splitlines()[0].split()[1]
    run = run_dir_of(run_id, env)
    return {"env": env, "job": job, "run_id": run_id, "dir": run, "records": records(run),
            "adapter": final_adapter_bytes(run)}


def test_grpo_killed_mid_checkpoint_paused_and_killed_mid_generation_resumes_bitwise(grpo_baseline, tmp_path):
    base = grpo_baseline["records"]
    train = [r for r in base if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert all({"reward", "reward_vowels", "reward_answer", "frac_reward_zero_std", "kl", "clip_ratio"} <= set(r)
               for r in train), train[0]
    assert any(r["grad_norm"] > 0 for r in train), "no step learned anything: the scenario tests nothing"
    evals = [r for r in base if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 4, 8] and all(len(r["eval_samples"]) == 2 for r in evals)
    env, job = grpo_baseline["env"], grpo_baseline["job"]

    # 1: death inside the second checkpoint's write (step 6): step 3's, with its kept completions, stays
    died = run_lodger(["run", job, "--quiet"], {**env, "LODGER_FAULT": "before_rename@2"})
    assert killed_by_sigkill(died.returncode), describe(died)
    run_id = died.stdout.splitlines()[0].split()[1]
    folder = run_dir_of(run_id, env)
    assert checkpoint_dirs(folder) == ["step-00000003"]
    assert (folder / "checkpoints" / "step-00000003" / "rollouts.safetensors").is_file()
    # 2: resume; frozen in the middle of sampling step 5's completions (the third decode step of the
    # segment's first sampling), the owner asks for the machine back; the run releases there
    seed = int(os.environ.get("LODGER_TEST_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    first = rng.randrange(2, DECODES_PER_SAMPLING)
    print(f"seed {seed}: freeze at decode step {first}")
    proc = start_lodger(["resume", run_id], {**env, "LODGER_FAULT": f"decode_step@{first}:stop"}, log_dir=tmp_path)
    try:
        wait_until(lambda: _stopped(proc.proc.pid), 120, proc.proc, what="the run frozen mid-generation")
        released = asked_while_frozen(proc, ["pause", run_id], env)
        assert released.returncode == 0 and "checkpoint committed" in released.stdout, describe(released)
        assert proc.wait() == 0, describe(proc)
    finally:
        proc.close()
    paused_at = show(run_id, env)["run"]["step"]
    assert paused_at == 4, paused_at  # step 5 was being sampled: dropped whole, step 4 committed
    # 3: resume; SIGKILL at a random decode step of a later sampling
    second = rng.randrange(1, 2 * DECODES_PER_SAMPLING)
    print(f"seed {seed}: SIGKILL at decode step {second}")
    killed = run_lodger(["resume", run_id], {**env, "LODGER_FAULT": f"decode_step@{second}"})
    assert killed_by_sigkill(killed.returncode), describe(killed)
    finished = run_lodger(["resume", run_id], env)
    assert finished.returncode == 0, describe(finished)

    assert records(folder) == base, "a resumed GRPO run logged other numbers than the uninterrupted one"
    assert final_adapter_bytes(folder) == grpo_baseline["adapter"]
    compared = run_lodger(["compare", run_id, grpo_baseline["run_id"]], env)
    assert compared.returncode == 0 and "bitwise equal" in compared.stdout, describe(compared)


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP), from /proc."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] == "T"


def test_grpo_run_shows_rewards_and_eval_samples(grpo_baseline):
    shown = run_lodger(["show", grpo_baseline["run_id"]], grpo_baseline["env"])
    assert shown.returncode == 0, describe(shown)
    assert "reward" in shown.stdout and "vowels" in shown.stdout, shown.stdout
    newest = [r for r in read_metrics(grpo_baseline["dir"]) if r["kind"] == "eval"][-1]["eval_samples"][0]
    assert newest["completion"][:20] in shown.stdout, shown.stdout
    info = show(grpo_baseline["run_id"], grpo_baseline["env"])
    rewards = info["provenance"][0]["data"]["rewards"]
    assert [r["label"] for r in rewards] == ["vowels", "answer"] and len(rewards[0]["sha256"]) == 64


def test_a_failing_reward_stops_at_a_clean_checkpoint_and_resumes_after_the_fix(tmp_path, tiny_model_dir):
    reward = tmp_path / "rewards.py"
    reward.write_text(VOWEL_REWARD + "\n_real = vowels\n\ndef vowels(prompts, completions, completion_ids, step, **kw):\n"
                      "    if step >= 2:\n        raise ValueError('broken on purpose')\n"
                      "    return _real(prompts, completions, completion_ids, **kw)\n")
    job = grpo_job(tmp_path, tiny_model_dir, reward)
    env = lodger_env(tmp_path / "home")
    failed = run_lodger(["run", job, "--quiet"], env)
    assert failed.returncode != 0, describe(failed)
    assert "reward 'vowels'" in failed.stderr and "at step 3" in failed.stderr and "broken on purpose" in failed.stderr
    assert "line" in failed.stderr and "Traceback" not in failed.stderr, failed.stderr
    run_id = next(line.split()[1] for line in failed.stdout.splitlines() if line.startswith("run "))
    folder = run_dir_of(run_id, env)
    assert checkpoint_dirs(folder) == ["step-00000002"]  # the last finished step, committed at the failure
    assert show(run_id, env)["run"]["status"] == "failed"

    reward.write_text(VOWEL_REWARD)  # fixed
    resumed = run_lodger(["resume", run_id], env)
    assert resumed.returncode == 0, describe(resumed)
    info = show(run_id, env)
    assert info["run"]["status"] == "finished" and "drift" in event_kinds(info)
    assert [r["step"] for r in read_metrics(folder) if r["kind"] == "train"] == list(range(1, STEPS + 1))
    drift = next(e for e in info["events"] if e["kind"] == "drift")
    assert any("reward vowels's file changed" in d for d in drift["data"]["differences"]), drift
