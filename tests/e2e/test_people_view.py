"""What people read: `ls` never cuts a run id; `status`, `ls` and `show` give the live step and the
last checkpoint's apart, rounded for people and exact in --json; none of them imports torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import describe, lodger_env, read_metrics, run_dir_of, run_lodger, start_lodger, wait_until, write_job
from lodger.control import clear_request, notify, run_state, write_request
from lodger.runlock import is_locked, lock_pid

LONG_NAME = "a-rather-long-experiment-name"  # ids of 51 characters: longer than a narrow terminal's columns


@pytest.fixture(scope="module")
def two_runs(tiny_model_dir: Path, e2e_data, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[str]]:
    """(environment, ids) of two finished runs in a home of their own."""
    folder = tmp_path_factory.mktemp("ls_runs")
    job = write_job(folder / "job.toml", model=tiny_model_dir, train=e2e_data["train"], name=LONG_NAME,
                    steps=2, every_steps=2, eval_every=None)
    env = lodger_env(folder / "home")
    ids = []
    for _ in range(2):  # the same job twice: the ids differ only in their time and random suffix
        result = run_lodger(["run", job, "--quiet"], env)
        assert result.returncode == 0, describe(result)
        ids.append(result.stdout.split()[1])
    return env, ids


def ls_output(env: dict[str, str], columns: int | None) -> str:
    env = dict(env)
    env.pop("COLUMNS", None)
    if columns is not None:
        env["COLUMNS"] = str(columns)
    result = run_lodger(["ls"], env)  # stdout is a pipe here; with COLUMNS set it is laid out for that width
    assert result.returncode == 0, describe(result)
    return result.stdout


@pytest.mark.parametrize("columns", [60, 80, 100, None], ids=["60-columns", "80-columns", "100-columns", "piped"])
def test_ls_never_cuts_a_run_id_and_show_accepts_what_it_prints(two_runs, columns):
    env, ids = two_runs
    out = ls_output(env, columns)
    lines = out.splitlines()
    for run_id in ids:
        printed = [line.split()[0] for line in lines if line.startswith(LONG_NAME)]
        assert run_id in printed, f"{run_id} is not printed whole at {columns} columns:\n{out}"
        info = json.loads(run_lodger(["show", run_id, "--json"], env).stdout)
        assert info["run"]["id"] == run_id
    if columns is not None:
        # the id and status always fit whole; the other columns give way
        assert all(len(line) <= max(columns, len(ids[0]) + len("  finished")) for line in lines), out
    else:
        assert "started" in lines[0], f"piped output has every column:\n{out}"
