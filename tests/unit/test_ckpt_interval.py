"""The "auto" checkpoint interval: Young/Daly, the interruption history read from ledger events,
the prior, the bounds and the expected loss."""

from __future__ import annotations

import math
import random

import pytest

from lodger.ckpt_interval import (CEILING_SECONDS, FLOOR_FACTOR, PRIOR_COST_SECONDS, PRIOR_HOURS, History,
                                  checkpoint_cost, choose_interval, daly_interval, expected_loss_per_interruption,
                                  interruption_history, mean_time_between_interruptions, young_interval)
from lodger.ledger import Ledger


def ev(run: str | None, kind: str, at: float, **data) -> dict:
    return {"run_id": run, "kind": kind, "time": at, "data": data}


def test_daly_tends_to_young_when_checkpoints_are_cheap_and_is_larger_when_they_are_not() -> None:
    assert young_interval(2.0, 86400) == pytest.approx(math.sqrt(2 * 2.0 * 86400))
    assert daly_interval(0.01, 1e7) == pytest.approx(young_interval(0.01, 1e7), rel=1e-3)
    c, m = 600.0, 3600.0
    ratio = c / (2 * m)
    assert daly_interval(c, m) == pytest.approx(math.sqrt(2 * c * m) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - c)
    assert daly_interval(8000.0, 3600.0) == 3600.0  # C >= 2M: checkpoint once per mean interval


def test_daly_minimises_the_expected_waste_of_a_simulated_poisson_trace() -> None:
    """The formula's interval beats half and double of it on a trace it never saw."""
    c, m = 30.0, 2 * 3600.0
    rng = random.Random(1)
    gaps = [rng.expovariate(1 / m) for _ in range(4000)]

    def waste(interval: float) -> float:
        lost = 0.0
        for gap in gaps:  # time since the last commit when the interruption struck
            lost += gap % (interval + c)
        cycles = sum(gaps) / (interval + c)
        return lost + cycles * c

    best = daly_interval(c, m)
    assert waste(best) < waste(best / 2) and waste(best) < waste(best * 2)


def test_expected_loss_is_half_a_cycle_and_the_poisson_mean_slightly_less() -> None:
    assert expected_loss_per_interruption(590.0, 10.0) == 300.0
    exact = expected_loss_per_interruption(590.0, 10.0, mtbi=86400.0)
    assert 295.0 < exact < 300.0
    rng = random.Random(2)
    samples = [g % 600.0 for g in (rng.expovariate(1 / 3000.0) for _ in range(200_000))]
    assert expected_loss_per_interruption(590.0, 10.0, mtbi=3000.0) == pytest.approx(
        sum(samples) / len(samples), rel=0.01)


def test_history_counts_only_segments_that_ended_without_a_clean_exit() -> None:
    events = [
        ev("a", "created", 0), ev("a", "started", 10), ev("a", "checkpoint", 50, step=5, seconds=2.0),
        ev("a", "pause_requested", 300, by="user"),                 # another process asking: no sign of life
        ev("a", "checkpoint", 490, step=6, recovered=True),         # the next process, completing the ledger
        ev("a", "provenance", 495, segment=1),
        ev("a", "resumed", 500),              # a's first process died after its checkpoint at t=50
        ev("a", "held", 520), ev("a", "interrupted", 600),          # clean: Ctrl-C commits first
        ev("a", "resumed", 1000), ev("a", "paused", 1100),          # clean: a release
        ev("b", "started", 2000), ev("b", "failed", 2300, error="RuntimeError: out of memory"),
        ev("c", "started", 3000), ev("c", "failed", 3100, error="TrainingDiverged: stopped: ..."),
        ev("d", "failed", 3200, error="OSError: no model"),          # failed while loading: no segment
        ev("e", "remote_event", 3300, remote_kind="started"), ev("e", "remote_job_ended", 3400, status="crashed"),
        ev(None, "agent_started", 3500),
        ev("f", "started", 4000), ev("f", "checkpoint", 4100), ev("f", "finished", 4200),
        ev("g", "started", 5000), ev("g", "checkpoint", 5060),       # still open (running, or dead)
    ]
    history = interruption_history(events)
    at_risk = (50 - 10) + (600 - 500) + (1100 - 1000) + (2300 - 2000) + (3100 - 3000) + (4200 - 4000) + (5060 - 5000)
    assert history == History(interruptions=2, seconds_at_risk=at_risk)
    assert interruption_history(events, crashed_runs={"g"}) == History(3, at_risk)


def test_no_history_gives_the_stated_prior() -> None:
    assert mean_time_between_interruptions(History()) == PRIOR_HOURS * 3600
    choice = choose_interval([], History())
    assert choice.cost == PRIOR_COST_SECONDS
    assert choice.seconds == pytest.approx(daly_interval(PRIOR_COST_SECONDS, PRIOR_HOURS * 3600))
    assert choice.bound is None and 400 < choice.seconds < 450


def test_bounds_hold_the_interval_between_ten_checkpoints_and_an_hour() -> None:
    calm = choose_interval([20.0], History(0, 1000 * 3600.0))  # sqrt(2 * 20 * ~1000 h) is over an hour
    assert calm.formula > CEILING_SECONDS and (calm.seconds, calm.bound) == (CEILING_SECONDS, "ceiling")
    stormy = choose_interval([60.0], History(200, 10 * 3600.0))  # M ~ 10 min: the formula gives < 10 C
    assert stormy.formula < FLOOR_FACTOR * 60 and (stormy.seconds, stormy.bound) == (600.0, "floor")
    slow = choose_interval([500.0], History())  # a save slower than 6 minutes: the floor wins
    assert (slow.seconds, slow.bound) == (5000.0, "floor")


def test_the_cost_is_the_median_of_the_recent_checkpoints() -> None:
    assert checkpoint_cost([1.0, 1.2, 30.0, 1.1, 0.9]) == 1.1
    assert checkpoint_cost([100.0] * 10 + [1.0] * 5) == 1.0  # only the last five
    assert checkpoint_cost([]) == PRIOR_COST_SECONDS


def test_auto_with_a_ledger_holding_a_known_history_picks_the_formulas_interval(lodger_home) -> None:
    with Ledger() as ledger:
        for run, ends in (("r1", ["died", "interrupted"]), ("r2", ["failed"]), ("r3", ["died", "died", "finished"])):
            ledger.create_run(run, name=run, model="m", method="lora", job_hash="h" * 64, job_toml="x = 1\n",
                              total_steps=10, pid=None)
            ledger.set_status(run, "running", "started", step=0, segment=0)
            for segment, end in enumerate(ends, start=1):
                ledger.event(run, "checkpoint", step=segment, path=f"step-{segment:08d}", seconds=0.5 * segment)
                if end == "died":
                    ledger.set_status(run, "running", "resumed", step=segment, segment=segment)
                elif end == "failed":
                    ledger.set_status(run, "failed", error="RuntimeError: boom", step=segment)
                else:
                    ledger.set_status(run, end, step=segment)
        events = ledger.events()
        costs = [e["data"]["seconds"] for e in ledger.events("r3") if e["kind"] == "checkpoint"]
    history = interruption_history(events)
    assert history.interruptions == 4  # r1 died once, r2 failed, r3 died twice
    choice = choose_interval(costs, history)
    mtbi = (PRIOR_HOURS * 3600 + history.seconds_at_risk) / (1 + 4)
    cost = sorted(costs)[1]
    c_over = cost / (2 * mtbi)
    expected = math.sqrt(2 * cost * mtbi) * (1 + math.sqrt(c_over) / 3 + c_over / 9) - cost
    assert (choice.cost, choice.interruptions) == (cost, 4)
    assert choice.mtbi == pytest.approx(mtbi)
    assert choice.seconds == pytest.approx(expected) and choice.bound is None
    assert choice.expected_loss == pytest.approx(expected_loss_per_interruption(expected, cost, mtbi))
    assert "checkpoint every" in choice.describe() and choice.as_event()["interruptions"] == 4
