"""`[checkpoints] every_seconds = "auto"` (the default) in a real run: the interval comes from the
ledger's interruption history and the run's measured checkpoint cost, is recorded as
`checkpoint_interval` events, and `lodger show` prints it. One short run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers import describe, lodger_env, run_lodger, show, write_job

from lodger.ledger import Ledger
from lodger.ledger.values import NewRun


def _history(ledger: Ledger) -> float:
    """Three unplanned interruptions on this machine (a process that died twice, an out-of-memory
    failure) and two that are not (a diverged run, a Ctrl-C). Returns the seconds at risk,
    summed by hand from the recorded times of each segment's opening and end."""
    def run(run_id: str) -> None:
        ledger.create_run(NewRun(run_id, name=run_id, model="m", method="lora", job_hash="h" * 64, job_toml="x = 1\n",
                          total_steps=10, pid=None))

    def status(run_id: str, state: str, event: str | None = None, **data) -> float:
        ledger.set_status(run_id, state, event, **data)
        return ledger.events(run_id)[-1]["time"]

    run("died-twice")
    opened = status("died-twice", "running", "started", step=0, segment=0)
    ledger.event("died-twice", "checkpoint", step=2, path="step-00000002", seconds=0.5)
    at_risk = ledger.events("died-twice")[-1]["time"] - opened  # died after this checkpoint, its last sign of life
    status("died-twice", "running", "resumed", step=2, segment=1)  # ...which the resume tells
    reopened = status("died-twice", "running", "resumed", step=2, segment=2)  # died at once: no time at risk
    at_risk += status("died-twice", "finished", step=10) - reopened
    run("oom")
    opened = status("oom", "running", "started", step=0, segment=0)
    at_risk += status("oom", "failed", error="RuntimeError: out of memory", step=3) - opened
    run("diverged")
    opened = status("diverged", "running", "started", step=0, segment=0)
    at_risk += status("diverged", "failed", error="TrainingDiverged: non-finite loss", step=3) - opened
    run("stopped")
    opened = status("stopped", "running", "started", step=0, segment=0)
    at_risk += status("stopped", "interrupted", step=1) - opened
    return at_risk


def test_auto_picks_the_formulas_interval_from_the_ledger_and_show_prints_it(tmp_path: Path, lodger_home: Path,
                                                                            tiny_model_dir: Path,
                                                                            chat_data: dict[str, Path]) -> None:
    with Ledger() as ledger:
        at_risk = _history(ledger)
    env = lodger_env(lodger_home)
    # every_seconds is left out: "auto" is the default. Saves at step 2 (measured) and 4; the loop
    # asks the interval at steps 1 (prior cost) and 3 (after the measured save).
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=chat_data["train"], steps=4, every_steps=2,
                    eval_every=None, name="interval")
    result = run_lodger(["run", job, "--quiet"], env)
    assert result.returncode == 0, describe(result)
    with Ledger() as ledger:
        run_id = next(r["id"] for r in ledger.runs() if r["name"] == "interval")
    info = show(run_id, env)
    assert info["run"]["status"] == "finished"
    chosen = [e["data"] for e in info["events"] if e["kind"] == "checkpoint_interval"]
    saves = [e["data"]["seconds"] for e in info["events"] if e["kind"] == "checkpoint"]
    assert len(saves) == 2 and len(chosen) == 2, chosen

    started = next(e["time"] for e in info["events"] if e["kind"] == "started")
    first_save = next(e["time"] for e in info["events"] if e["kind"] == "checkpoint")
    # chosen at step 1 (this run's own segment has no time at risk yet) and again at step 3, after
    # the first save: the history read again then holds this run's segment up to that save
    for data, cost, measured, own in ((chosen[0], 1.0, 0, 0.0), (chosen[1], saves[0], 1, first_save - started)):
        mtbi = (24 * 3600 + at_risk + own) / (1 + 3)  # the stated prior (1 per 24 h) plus 3 interruptions
        ratio = cost / (2 * mtbi)
        daly = math.sqrt(2 * cost * mtbi) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost
        assert (data["interruptions"], data["costs_measured"], data["bound"]) == (3, measured, None), data
        assert data["rate_source"] == "history" and data["cost_source"] == ("measured" if measured else "prior")
        assert data["cost"] == pytest.approx(cost, abs=1e-3)
        assert data["mtbi"] == pytest.approx(mtbi, abs=1e-3)  # the event rounds to 3 decimals
        assert data["seconds"] == pytest.approx(daly, abs=1e-3)
        cycle = daly + cost  # work lost on average: the Poisson mean of the time since the last commit
        lost = mtbi - cycle * math.exp(-cycle / mtbi) / -math.expm1(-cycle / mtbi)
        assert data["expected_loss"] == pytest.approx(lost, abs=1e-3)

    text = run_lodger(["show", run_id], env)
    assert text.returncode == 0, describe(text)
    line = next(x for x in text.stdout.splitlines() if x.startswith("interval  "))
    newest = chosen[-1]
    assert line.startswith(f"interval  checkpoint every {newest['seconds']:.0f} s (checkpoint cost "
                           f"{newest['cost']:.2f} s, median of the last 1 measured; one unplanned interruption "
                           f"per {newest['mtbi'] / 3600:.1f} h from 3 in "), line
    assert line.endswith(f"expected work lost per interruption {newest['expected_loss']:.0f} s"), line

