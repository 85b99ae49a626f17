"""The "auto" checkpoint interval: Young/Daly, the interruption history read from ledger events,
the prior, the bounds and the expected loss."""

from __future__ import annotations

import math
import random

import pytest

from lodger.ckpt_interval import (CEILING_SECONDS, FLOOR_FACTOR, PRIOR_COST_SECONDS, PRIOR_HOURS, AutoInterval,
                                  FixedInterval, History, checkpoint_cost, choose_interval, daly_interval,
                                  describe_event, expected_loss_per_interruption, interruption_history, interval_for,
                                  machine_history, mean_time_between_interruptions, young_interval)
from lodger.home import run_dir
from lodger.ledger import Ledger
from lodger.owner.runlock import RunLock
from lodger.ledger.values import NewRun


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
            ledger.create_run(NewRun(run, name=run, model="m", method="lora", job_hash="h" * 64, job_toml="x = 1\n",
                              total_steps=10, pid=None))
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


def _run(ledger: Ledger, run: str, status: str | None = None) -> None:
    ledger.create_run(NewRun(run, name=run, model="m", method="lora", job_hash="h" * 64, job_toml="x = 1\n",
                      total_steps=10, pid=None))
    if status:
        ledger.set_status(run, status, "started", step=0, segment=0)


def test_machine_history_counts_a_dead_run_nobody_resumed_but_not_a_live_one_nor_itself(lodger_home) -> None:
    with Ledger() as ledger:
        for run in ("dead", "alive", "me"):
            _run(ledger, run, "running")  # each left its segment open
        run_dir("alive").mkdir(parents=True)
        lock = RunLock(run_dir("alive"))  # a live process trains "alive"
        try:
            assert machine_history(ledger, "me").interruptions == 1  # "dead" only
            assert machine_history(ledger).interruptions == 2        # seen from outside, "me" is dead too
        finally:
            lock.release()
        assert machine_history(ledger, "me").interruptions == 2


def test_auto_in_a_run_reads_the_real_ledger_chooses_records_and_rechooses_on_new_costs(lodger_home) -> None:
    """The live object a run's save_due asks: the formula's interval from the ledger's history and
    the run's checkpoint events, recorded as `checkpoint_interval` when it moves more than 20 %."""
    with Ledger() as ledger:
        _run(ledger, "old", "running")
        ledger.set_status("old", "running", "resumed", step=0, segment=1)      # its first process died
        ledger.set_status("old", "failed", error="RuntimeError: out of memory", step=0)  # then an OOM
        _run(ledger, "me", "running")
        history = interruption_history(ledger.events())
        assert history.interruptions == 2
        mtbi = (PRIOR_HOURS * 3600 + history.seconds_at_risk) / 3

        auto = interval_for("auto", ledger, "me")
        assert isinstance(auto, AutoInterval) and auto.seconds(100.0) == pytest.approx(daly_interval(1.0, mtbi))
        assert auto.seconds(100.0) == auto.choice.seconds  # asked again with nothing new: no new event
        first = [e["data"] for e in ledger.events("me") if e["kind"] == "checkpoint_interval"]
        assert len(first) == 1 and first[0]["cost_source"] == "prior" and first[0]["rate_source"] == "history"
        assert first[0]["interruptions"] == 2 and first[0]["costs_measured"] == 0

        ledger.event("me", "checkpoint", step=2, path="step-00000002", seconds=0.05)
        moved = auto.seconds(200.0)  # last_save moved: a checkpoint was committed
        assert moved == pytest.approx(daly_interval(0.05, mtbi))
        ledger.event("me", "checkpoint", step=4, path="step-00000004", seconds=0.052)
        ledger.event("me", "checkpoint", step=4, path="step-00000004", seconds=9.0, recovered=True)  # not measured here
        assert auto.seconds(300.0) == pytest.approx(daly_interval(0.051, mtbi))  # median of 0.05, 0.052
        events = [e["data"] for e in ledger.events("me") if e["kind"] == "checkpoint_interval"]
        assert len(events) == 2  # 0.051 s moved the interval by 1 %: not recorded again
        for run in ("oom-1", "oom-2"):  # meanwhile two other runs fail: the next checkpoint reads them
            _run(ledger, run, "running")
            ledger.set_status(run, "failed", error="RuntimeError: out of memory", step=0)
        assert auto.seconds(300.0) == pytest.approx(daly_interval(0.051, mtbi))  # no new checkpoint: as it was
        ledger.event("me", "checkpoint", step=6, path="step-00000006", seconds=0.051)
        later = interruption_history(ledger.events())
        assert later.interruptions == 4
        mtbi_later = (PRIOR_HOURS * 3600 + later.seconds_at_risk) / 5
        assert auto.seconds(400.0) == pytest.approx(daly_interval(0.051, mtbi_later))  # sqrt(3/5): 23 % shorter
        events = [e["data"] for e in ledger.events("me") if e["kind"] == "checkpoint_interval"]
    assert len(events) == 3 and events[-1]["interruptions"] == 4 and events[-1]["costs_measured"] == 3
    last = events[1]
    assert (last["costs_measured"], last["cost"], last["cost_source"]) == (1, 0.05, "measured")
    assert last["seconds"] == pytest.approx(daly_interval(0.05, mtbi), abs=1e-3)
    assert last["expected_loss"] == pytest.approx(
        expected_loss_per_interruption(daly_interval(0.05, mtbi), 0.05, mtbi), abs=1e-3)
    line = describe_event(last)
    assert line.startswith(f"checkpoint every {last['seconds']:.0f} s (checkpoint cost 0.05 s, median of the last 1")
    assert f"from 2 in {history.seconds_at_risk / 3600:.1f} h of training" in line
    assert line.endswith(f"expected work lost per interruption {last['expected_loss']:.0f} s")

def test_a_fixed_interval_and_a_rank_without_the_ledger_never_touch_it() -> None:
    assert interval_for(600.0, None, "r").seconds(1.0) == 600.0
    assert interval_for(0.0, None, "r").seconds(1.0) is None  # 0: no time-based checkpoints
    assert isinstance(interval_for("auto", None, "r"), FixedInterval)  # ranks > 0: rank 0 decides
    assert describe_event(choose_interval([], History()).as_event()).count("no history yet, only a prior") == 1
    assert describe_event({"seconds": "soon"}).startswith("checkpoint interval recorded in a form this version")
