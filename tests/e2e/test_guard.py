"""The non-finite guard end to end: poisoned samples (test-only fault injection through
$LODGER_TEST_POISON_LINES, which multiplies a micro-batch's loss by Inf) are skipped with no
weight change, repeated poison rolls back, and the ledger tells the story."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from helpers import describe, lodger_env, read_metrics, run_dir_of, run_lodger, show, write_job  # noqa: E402

from fixtures_lib import write_chat_jsonl  # noqa: E402

EXAMPLES = 256


def lines_of_steps(job: Path, steps: list[int]) -> list[int]:
    """The data lines drawn by these 1-based steps, from the job's own step plans (packed under
    the default [training] packing = "auto"): the guard must skip exactly these examples."""
    from lodger.lifecycle.jobfile import load_job
    from lodger.lifecycle.prepare import prepare

    prepared = prepare(load_job(job))
    position, lines = 0, set()
    for step in range(1, max(steps) + 1):
        plan = prepared.planner.plan(position)
        if step in steps:
            lines |= {int(prepared.train_set.lines[i]) for i in plan.indices()}
        position = plan.end
    return sorted(lines)


def run_poisoned(tmp_path: Path, tiny_model_dir: Path, steps: list[int], total: int = 24):
    train = write_chat_jsonl(tmp_path / "train.jsonl", EXAMPLES, 3)
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=train, steps=total, every_steps=4,
                    eval_every=None, dropout=0.0, keep_last=3, eval_fraction=0.0,
                    extra={"guard": {"max_bad_steps": 3}})
    env = lodger_env(tmp_path / "home", LODGER_TEST_POISON_LINES=",".join(map(str, lines_of_steps(job, steps))))
    result = run_lodger(["run", job, "--quiet"], env)
    run_id = result.stdout.split()[1]
    return result, run_id, run_dir_of(run_id, env), env, job


def test_poisoned_steps_are_skipped_named_and_leave_the_adapter_exactly_as_it_was(tmp_path, tiny_model_dir):
    """Steps 7 and 8 poisoned (two in a row: below the rollback threshold of 3). Each is skipped with
    its non-finite loss and one warning naming lines it drew; the final adapter is the state after step 6.
    (One run for what were two tests, of one poisoned step and of two.)"""
    result, run_id, folder, env, job = run_poisoned(tmp_path, tiny_model_dir, [7, 8], total=8)
    assert result.returncode == 0, describe(result)
    records = {r["step"]: r for r in read_metrics(folder) if r["kind"] == "train"}
    for step in (7, 8):
        assert records[step].get("skipped") and not math.isfinite(records[step]["loss"]), records[step]
    assert all(not records[s].get("skipped") for s in records if s not in (7, 8))
    warnings = [e["data"] for e in show(run_id, env)["events"] if e["kind"] == "warning"]
    assert [w["step"] for w in warnings] == [7, 8], warnings
    for warning in warnings:
        assert warning["sample_lines"] and set(warning["sample_lines"]) <= set(lines_of_steps(job, [warning["step"]]))
    # steps 5 and 6 update, 7 and 8 are skipped: the final adapter equals the state after step 6,
    # which is what the checkpoint of a run stopped after 6 steps holds
    short = write_job(tmp_path / "short.toml", model=tiny_model_dir, train=tmp_path / "train.jsonl", steps=8,
                      every_steps=2, eval_every=None, dropout=0.0, keep_last=8, eval_fraction=0.0)
    clean_env = lodger_env(tmp_path / "home-clean")
    clean = run_lodger(["run", short, "--quiet"], clean_env)
    assert clean.returncode == 0, describe(clean)
    step6 = run_dir_of(clean.stdout.split()[1], clean_env) / "checkpoints" / "step-00000006"
    poisoned_final = load_file(str(folder / "adapter" / "adapter_model.safetensors"))
    at_step6 = load_file(str(step6 / "adapter_model.safetensors"))
    assert all((poisoned_final[k] == at_step6[k]).all() for k in at_step6)


def test_repeated_poison_rolls_back_and_the_run_finishes_with_the_story_in_the_ledger(tmp_path, tiny_model_dir):
    result, run_id, folder, env, job = run_poisoned(tmp_path, tiny_model_dir, [10, 11, 12])
    assert result.returncode == 0, describe(result)
    info = show(run_id, env)
    assert info["run"]["status"] == "finished"
    rollbacks = [e["data"] for e in info["events"] if e["kind"] == "rollback"]
    assert len(rollbacks) == 1, rollbacks
    assert rollbacks[0]["bad_steps"] == [10, 11, 12] and rollbacks[0]["to_step"] == 8
    assert rollbacks[0]["lr_scale"] == 0.5 and len(rollbacks[0]["skipped_batches"]) == 3
    records = [r for r in read_metrics(folder) if r["kind"] == "train"]
    assert [r["step"] for r in records] == list(range(1, 25)), "one stitched curve after the rollback"
    assert all(math.isfinite(r["loss"]) for r in records), "the poisoned batches were skipped after rollback"
