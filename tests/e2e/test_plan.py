"""`lodger plan JOB --memory X` on the tiny Llama: the real command, through lodger's own estimate.

A limit just under the job's own predicted peak makes the planner change something; the setting
it marks is written as a new job file that lodger loads and whose estimate is the peak the plan
showed. Nothing fits: exit 2, by how much, nothing written. A limit that is not a size names the
value and how to write one, and nothing is written either."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import STANDARD_JOB, describe, lodger_env, run_lodger, write_job

GiB = 2**30


@pytest.fixture(scope="module")
def plan_home(tmp_path_factory) -> dict[str, str]:
    """One home for the module: the runtime's size is measured once and cached there."""
    return lodger_env(tmp_path_factory.mktemp("plan_home"))


@pytest.fixture
def plan_setup(tmp_path, tiny_model_dir, e2e_data, plan_home) -> dict:
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=e2e_data["train"], name="plan",
                    **STANDARD_JOB)
    return {"job": job, "env": plan_home}


def _plan(setup: dict, memory: str, out: Path, *extra: str):
    return run_lodger(["plan", setup["job"], "--memory", memory, "--out", out, *extra], setup["env"])


def test_plan_writes_a_setting_that_fits_just_under_the_jobs_own_peak_as_a_job_lodger_loads(plan_setup, tmp_path):
    from lodger.lifecycle.jobfile import load_job

    listed = _plan(plan_setup, "100GiB", tmp_path / "roomy.toml", "--json")
    assert listed.returncode == 0, describe(listed)
    options = json.loads(listed.stdout)["options"]
    now = next(o for o in options if not o["changes"])
    assert now["fits"] and all(o["step_seconds"] > 0 for o in options)
    assert min(o["peak_bytes"] for o in options) < now["peak_bytes"], "something the planner may change saves memory"

    budget = now["peak_bytes"] - 1
    out = tmp_path / "tight.toml"
    done = _plan(plan_setup, f"{budget}B", out)
    assert done.returncode == 0, describe(done)
    chosen = next(line for line in done.stdout.splitlines() if line.startswith("->"))
    found = re.search(r"1\. (.+): peak ([0-9.]+) GiB, ([0-9.]+) s/step", chosen)
    assert found, chosen
    assert f"wrote {out}" in done.stdout
    planned = load_job(out)  # lodger's own loader: a job file it runs
    bits, gc = planned.method.base_bits, planned.training.gradient_checkpointing
    assert found.group(1) == (f"{f'{bits}-bit' if bits else 'fp32'} base, checkpointing {'on' if gc else 'off'}, "
                              f"batch {planned.training.batch_size} x accum {planned.training.grad_accum}, "
                              f"max_length {planned.data.max_length}")
    assert found.group(1) != next(o["setting"] for o in options if not o["changes"]), "the job changed to fit"
    assert planned.training.batch_size * planned.training.grad_accum == 8, "the same examples per optimizer step"

    estimated = run_lodger(["estimate", out, "--json"], plan_setup["env"])
    assert estimated.returncode == 0, describe(estimated)
    peak = json.loads(estimated.stdout)["estimate"]["total_bytes"]
    assert peak <= budget and abs(peak / GiB - float(found.group(2))) < 0.01, (peak, chosen)


def test_plan_refuses_by_how_much_when_nothing_fits_and_writes_nothing(plan_setup, tmp_path):
    out = tmp_path / "none.toml"
    done = _plan(plan_setup, "100MiB", out)
    assert done.returncode == 2, describe(done)
    assert done.stderr.startswith("error: nothing the planner may change makes this job fit in 0.10 GiB"), done.stderr
    assert re.search(r"needs an estimated [0-9.]+ GiB, [0-9.]+ GiB over", done.stderr), done.stderr
    assert "Traceback" not in done.stderr and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".toml") == ["job.toml"]


@pytest.mark.parametrize("memory", ["16 gigs", "-1GiB", "GiB"])
def test_a_memory_limit_that_is_not_a_size_names_the_value_and_the_fix(plan_setup, tmp_path, memory):
    out = tmp_path / "bad.toml"
    done = _plan(plan_setup, memory, out)
    assert done.returncode == 2, describe(done)
    assert done.stderr.startswith(f"error: --memory {memory!r}: not a size; write it as e.g. 16GiB"), done.stderr
    assert "Traceback" not in done.stderr and not out.exists()
