"""A kill around the ledger writes of the checkpoint path, then resume: the ledger ends complete.

Each fault point of recovery.LEDGER_FAULT_POINTS kills the real `lodger` process (SIGKILL through
$LODGER_FAULT) just after the run's row is created, between a checkpoint's commit and its ledger
write, after that write, or inside the resume that completes the ledger. After `lodger resume` the ledger must hold
every step's metrics
once, every checkpoint's event, and `lodger compare RUN BASELINE` must say bitwise equal.

Cost: one module home holds the uninterrupted baseline and one run killed just after committing
its step-8 checkpoint (before the ledger heard of it); each case works on a copy of that home.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from helpers import (describe, killed_by_sigkill, lodger_env, read_metrics, run_lodger, write_job)
from lodger.train.recovery import LEDGER_FAULT_POINTS

STEPS, EVERY = 12, 4
JOB = dict(steps=STEPS, batch_size=4, grad_accum=2, every_steps=EVERY, keep_last=2, threads=1, max_length=64,
           dropout=0.1, eval_every=4, name="recovery")
GAP_FAULT = "checkpoint_before_ledger@2"  # step-8 committed, the ledger still at step 4

# fault point -> the faults, in order, of the processes that die before a plain `lodger resume`
CASES = {
    "after_create_run": ["after_create_run"],
    "checkpoint_before_ledger": [GAP_FAULT],
    "checkpoint_after_ledger": ["checkpoint_after_ledger@2"],
    "after_metrics_truncate": [GAP_FAULT, "after_metrics_truncate"],
    "after_ledger_recovery": [GAP_FAULT, "after_ledger_recovery"],
}


def _rows(home: Path, sql: str, *args) -> list[tuple]:
    db = sqlite3.connect(f"file:{home / 'ledger.db'}?mode=ro", uri=True)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def _first_run_id(result) -> str:
    first = result.stdout.splitlines()[0] if result.stdout else ""
    assert first.startswith("run "), describe(result)
    return first.split()[1]


def _checkpoint_events(home: Path, run_id: str) -> list[dict]:
    return [json.loads(d) for (d,) in _rows(home, "SELECT data FROM events WHERE run_id=? AND kind='checkpoint' "
                                                  "ORDER BY seq", run_id)]


@pytest.fixture(scope="module")
def module_home(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, e2e_data) -> dict:
    root = tmp_path_factory.mktemp("recovery")
    job = write_job(root / "job.toml", model=tiny_model_dir, train=e2e_data["train"], eval=e2e_data["eval"], **JOB)
    home = root / "home"
    base = run_lodger(["run", job, "--quiet"], lodger_env(home))
    assert base.returncode == 0, describe(base)
    killed = run_lodger(["run", job, "--quiet"], lodger_env(home, LODGER_FAULT=GAP_FAULT))
    assert killed_by_sigkill(killed.returncode), describe(killed)
    return {"home": home, "job": job, "baseline": _first_run_id(base), "gap_run": _first_run_id(killed)}


def test_cases_cover_every_ledger_fault_point():
    assert set(CASES) == set(LEDGER_FAULT_POINTS)


def test_a_kill_between_commit_and_ledger_write_leaves_the_gap_resume_must_fill(module_home, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(module_home["home"], home)
    run_id = module_home["gap_run"]
    assert (home / "runs" / run_id / "checkpoints" / "step-00000008").is_dir()
    steps = [s for (s,) in _rows(home, "SELECT step FROM metrics WHERE run_id=? AND kind='train' ORDER BY step",
                                 run_id)]
    assert steps == list(range(1, EVERY + 1)), "the fault point is meant to fall before the ledger write"
    assert [e["step"] for e in _checkpoint_events(home, run_id)] == [EVERY]


@pytest.mark.parametrize("point", list(CASES))
def test_kill_at_ledger_fault_point_then_resume_leaves_the_ledger_complete(point, module_home, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(module_home["home"], home)
    faults = CASES[point]
    if faults[0] == GAP_FAULT:
        run_id = module_home["gap_run"]
    else:
        first = run_lodger(["run", module_home["job"], "--quiet"], lodger_env(home, LODGER_FAULT=faults[0]))
        assert killed_by_sigkill(first.returncode), describe(first)
        ((run_id,),) = _rows(home, "SELECT id FROM runs ORDER BY created DESC LIMIT 1")  # it may die before printing it
    for fault in faults[1:]:  # a resume that itself dies at the fault point
        dying = run_lodger(["resume", run_id, "--quiet"], lodger_env(home, LODGER_FAULT=fault))
        assert killed_by_sigkill(dying.returncode), f"expected death at {fault}: " + describe(dying)
    resumed = run_lodger(["resume", run_id], lodger_env(home))
    assert resumed.returncode == 0, describe(resumed)
    _assert_ledger_complete(home, run_id, recovered=faults[0] == GAP_FAULT)

    compared = run_lodger(["compare", run_id, module_home["baseline"], "--json"], lodger_env(home))
    assert compared.returncode == 0, describe(compared)
    verdict = json.loads(compared.stdout)["verdict"]
    assert verdict.startswith("bitwise equal"), verdict
    audited = run_lodger(["audit"], lodger_env(home))  # recovered rows are chained like live ones
    assert audited.returncode == 0, describe(audited)


def _assert_ledger_complete(home: Path, run_id: str, recovered: bool) -> None:
    """Every line of metrics.jsonl is a ledger row (and nothing else is); every checkpoint has an event."""
    lines = read_metrics(home / "runs" / run_id)
    assert [r["step"] for r in lines if r["kind"] == "train"] == list(range(1, STEPS + 1))
    rows = _rows(home, "SELECT kind, step, data FROM metrics WHERE run_id=? ORDER BY kind, step", run_id)
    assert [(k, s) for k, s, _ in rows if k == "train"] == [("train", s) for s in range(1, STEPS + 1)]
    assert [s for k, s, _ in rows if k == "eval"] == list(range(0, STEPS + 1, 4))
    assert {(r["kind"], r["step"]): r for r in lines} == {(k, s): json.loads(d) for k, s, d in rows}, \
        "ledger rows must be the run folder's metric lines, value for value"
    events = _checkpoint_events(home, run_id)
    assert sorted({e["step"] for e in events}) == list(range(EVERY, STEPS + 1, EVERY)), events
    marked = [e["step"] for e in events if e.get("recovered")]
    assert marked == ([2 * EVERY] if recovered else []), events
    (step, status), = _rows(home, "SELECT step, status FROM runs WHERE id=?", run_id)
    assert (step, status) == (STEPS, "finished")
