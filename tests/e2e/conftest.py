"""Fixtures for end-to-end tests: shared data, the standard job file, and one uninterrupted baseline run.

The baseline is trained once per session, for all of xdist's workers (``built_once`` in the
folder they share), in its own LODGER_HOME (the autouse fixture gives every test a fresh one,
which the baseline must not depend on). Every exactness test runs the same job file in its own
home and compares against it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from fixtures_lib import built_once, write_chat_jsonl
from helpers import (STANDARD_JOB, TOTAL_STEPS, WORLD, describe, eval_losses, final_adapter_bytes, killed_by_sigkill,
                     lodger_env, run_dir_of, run_lodger, train_losses, train_records, write_job)


@pytest.fixture(scope="session")
def e2e_data(shared_root: Path) -> dict[str, Path]:
    """Chat data shared by every e2e run (same bytes for baseline and test runs)."""
    folder = built_once(shared_root, "e2e_data", lambda f: (write_chat_jsonl(f / "train.jsonl", 64, seed=0),
                                                            write_chat_jsonl(f / "eval.jsonl", 16, seed=1)))
    return {"train": folder / "train.jsonl", "eval": folder / "eval.jsonl"}


@pytest.fixture(scope="session")
def standard_job(shared_root: Path, tiny_model_dir: Path, e2e_data) -> Path:
    """The job file of the baseline; tests that compare against the baseline run this same file."""
    return built_once(shared_root, "e2e_job", lambda f: write_job(
        f / "job.toml", model=tiny_model_dir, train=e2e_data["train"], eval=e2e_data["eval"], **STANDARD_JOB)) / "job.toml"


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


def _run_in_home(job: Path, fault: str | None = None) -> Callable[[Path], None]:
    """A builder for ``built_once``: ``lodger run JOB`` in ``folder/home`` (``fault``: LODGER_FAULT,
    the run must die of it by SIGKILL), its run id kept in ``folder/run_id``."""
    def build(folder: Path) -> None:
        home = folder / "home"
        home.mkdir(mode=0o700)  # as lodger makes a new home: owner-only
        env = lodger_env(home, **({"LODGER_FAULT": fault} if fault else {}))
        result = run_lodger(["run", job, "--quiet"], env)
        if fault:
            assert killed_by_sigkill(result.returncode), describe(result)
        else:
            assert result.returncode == 0, describe(result)
        (folder / "run_id").write_text(result.stdout.splitlines()[0].split()[1])
    return build


def _home_and_run(folder: Path) -> tuple[Path, str]:
    return folder / "home", (folder / "run_id").read_text()


@pytest.fixture(scope="session")
def baseline(shared_root: Path, standard_job: Path) -> Baseline:
    """The standard job run once for the session (all workers), in its own home: read it, copy it,
    never write into it."""
    home, run_id = _home_and_run(built_once(shared_root, "baseline", _run_in_home(standard_job)))
    folder = run_dir_of(run_id, lodger_env(home))
    losses = train_losses(folder)
    assert [s for s, _ in losses] == list(range(1, TOTAL_STEPS + 1)), losses
    return Baseline(home, run_id, folder, losses, train_records(folder), eval_losses(folder),
                    final_adapter_bytes(folder))


@pytest.fixture(scope="session")
def ddp_job(shared_root: Path, tiny_model_dir: Path, e2e_data) -> Path:
    """The standard job (24 steps, checkpoint every 4, LoRA dropout) with two ranks of one thread each."""
    return built_once(shared_root, "ddp_job", lambda f: write_job(
        f / "job.toml", model=tiny_model_dir, train=e2e_data["train"], eval=e2e_data["eval"], **STANDARD_JOB,
        extra={"training": {"world_size": WORLD}})) / "job.toml"


@pytest.fixture(scope="session")
def ddp_baseline(shared_root: Path, ddp_job: Path) -> dict:
    """One uninterrupted two-rank run, in its own home (once for all workers; read only)."""
    home, run_id = _home_and_run(built_once(shared_root, "ddp_baseline", _run_in_home(ddp_job)))
    env = lodger_env(home)
    folder = run_dir_of(run_id, env)
    return {"env": env, "run_id": run_id, "dir": folder, "records": train_records(folder),
            "evals": eval_losses(folder), "adapter": final_adapter_bytes(folder)}


KILLED_FAULT = "before_manifest@3"
"""Where the shared killed run died: writing its third checkpoint (step 12), with step-4 and step-8 committed."""


@pytest.fixture(scope="session")
def _killed_home(shared_root: Path, standard_job: Path) -> tuple[Path, str]:
    """(home, run id) of the standard job killed at KILLED_FAULT, once for all workers: copy it, never write into it."""
    return _home_and_run(built_once(shared_root, "killed", _run_in_home(standard_job, KILLED_FAULT)))


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
