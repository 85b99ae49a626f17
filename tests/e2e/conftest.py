"""Fixtures for end-to-end tests: shared data, the standard job file, and one uninterrupted baseline run.

The baseline is trained once per session in its own LODGER_HOME (the autouse fixture gives every
test a fresh one, which the baseline must not depend on). Every exactness test runs the same job
file in its own home and compares against it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from fixtures_lib import write_chat_jsonl
from helpers import (STANDARD_JOB, TOTAL_STEPS, WORLD, describe, eval_losses, final_adapter_bytes, killed_by_sigkill,
                     lodger_env, run_dir_of, run_lodger, train_losses, train_records, write_job)


@pytest.fixture(scope="session")
def e2e_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Chat data shared by every e2e run (same bytes for baseline and test runs)."""
    folder = tmp_path_factory.mktemp("e2e_data")
    return {"train": write_chat_jsonl(folder / "train.jsonl", 64, seed=0),
            "eval": write_chat_jsonl(folder / "eval.jsonl", 16, seed=1)}


@pytest.fixture(scope="session")
def standard_job(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, e2e_data) -> Path:
    """The job file of the baseline; tests that compare against the baseline run this same file."""
    return write_job(tmp_path_factory.mktemp("e2e_job") / "job.toml", model=tiny_model_dir,
                     train=e2e_data["train"], eval=e2e_data["eval"], **STANDARD_JOB)


@dataclass(frozen=True)
class Baseline:
    """An uninterrupted run of the standard job."""

    home: Path
    run_id: str
    run_dir: Path
    losses: list[tuple[int, float]]
    records: list[dict]
    evals: list[tuple[int, float]]
    adapter: bytes


@pytest.fixture(scope="session")
def baseline(tmp_path_factory: pytest.TempPathFactory, standard_job: Path) -> Baseline:
    home = tmp_path_factory.mktemp("baseline_home")
    env = lodger_env(home)
    result = run_lodger(["run", standard_job, "--quiet"], env)
    assert result.returncode == 0, describe(result)
    run_id = result.stdout.splitlines()[0].split()[1]
    folder = run_dir_of(run_id, env)
    losses = train_losses(folder)
    assert [s for s, _ in losses] == list(range(1, TOTAL_STEPS + 1)), losses
    return Baseline(home, run_id, folder, losses, train_records(folder), eval_losses(folder),
                    final_adapter_bytes(folder))


@pytest.fixture(scope="session")
def ddp_job(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, e2e_data) -> Path:
    """The standard job (24 steps, checkpoint every 4, LoRA dropout) with two ranks of one thread each."""
    return write_job(tmp_path_factory.mktemp("ddp_job") / "job.toml", model=tiny_model_dir,
                     train=e2e_data["train"], eval=e2e_data["eval"], **STANDARD_JOB,
                     extra={"training": {"world_size": WORLD}})


@pytest.fixture(scope="session")
def ddp_baseline(tmp_path_factory: pytest.TempPathFactory, ddp_job: Path) -> dict:
    """One uninterrupted two-rank run, in its own home."""
    env = lodger_env(tmp_path_factory.mktemp("ddp_baseline_home"))
    result = run_lodger(["run", ddp_job, "--quiet"], env)
    assert result.returncode == 0, describe(result)
    run_id = result.stdout.splitlines()[0].split()[1]
    folder = run_dir_of(run_id, env)
    return {"env": env, "run_id": run_id, "dir": folder, "records": train_records(folder),
            "evals": eval_losses(folder), "adapter": final_adapter_bytes(folder)}


KILLED_FAULT = "before_manifest@3"
"""Where the shared killed run died: writing its third checkpoint (step 12), with step-4 and step-8 committed."""


@pytest.fixture(scope="session")
def _killed_home(tmp_path_factory: pytest.TempPathFactory, standard_job: Path) -> tuple[Path, str]:
    home = tmp_path_factory.mktemp("killed_home")
    result = run_lodger(["run", standard_job, "--quiet"], lodger_env(home, LODGER_FAULT=KILLED_FAULT))
    assert killed_by_sigkill(result.returncode), describe(result)
    return home, result.stdout.splitlines()[0].split()[1]


@pytest.fixture
def killed_run(_killed_home, lodger_home: Path) -> tuple[str, Path]:
    """(run id, run folder) of the standard job SIGKILLed at KILLED_FAULT, copied into this test's home.

    Copying a home (ledger, run folder, caches) is what a backup restore does; it saves each test
    that only needs "a killed run" a training process of its own.
    """
    src, run_id = _killed_home
    shutil.copytree(src, lodger_home, dirs_exist_ok=True)
    return run_id, lodger_home / "runs" / run_id


@pytest.fixture(scope="session")
def baseline_server(baseline, tmp_path_factory):
    """(server, run id, home): `lodger serve --run BASELINE` (token, yielding) on a copy of the
    baseline's home, shared by test_serve.py and test_serve_openai.py. Their tests only send requests
    (and `lodger chat` reads the home), so sharing costs them nothing but a server start each."""
    from serve_helpers import start_server

    home = tmp_path_factory.mktemp("served_home")
    shutil.copytree(baseline.home, home, dirs_exist_ok=True)
    env = lodger_env(home)
    env.pop("LODGER_API_TOKEN", None)
    server = start_server(["--run", baseline.run_id], env, tmp_path_factory.mktemp("served_logs"))
    yield server, baseline.run_id, home
    server.close()
