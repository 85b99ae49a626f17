"""The peak MFU divides by: measured when the machine is quiet, or again, with its conditions kept."""

from __future__ import annotations

import json

import torch

from lodger.lifecycle.runview import rate_text
from lodger.train import throughput
from lodger.train.throughput import StepWork, better, measure_once, rate_record


def fake(rate: float, quiet: bool, **extra) -> dict:
    return {"flops_per_second": rate, "threads": 2, "precision": "fp32", "device": "cpu", "seconds": 0.2,
            "others": 0.01 if quiet else 0.6, "load": 0.3 if quiet else 3.5, "quiet": quiet,
            "measured_at": 1_800_000_000.0, "tries": 1, **extra}


def test_a_measurement_records_what_else_the_machine_was_doing():
    found = measure_once(1, seconds=0.05)
    assert found["flops_per_second"] > 1e8
    assert set(found) >= {"threads", "precision", "device", "seconds", "others", "load", "quiet", "measured_at"}
    assert found["others"] is None or 0.0 <= found["others"] <= 1.0
    assert found["quiet"] == (found["others"] is None or found["others"] < throughput.QUIET_OTHERS)


def test_a_quiet_measurement_beats_a_faster_looking_busy_one_and_then_speed_decides():
    assert better(fake(1e10, True), fake(5e10, False))
    assert better(fake(6e10, True), fake(5e10, True)) and not better(fake(4e10, True), fake(5e10, True))


def test_a_busy_cached_rate_is_measured_again_and_a_quiet_one_is_kept(monkeypatch, lodger_home):
    measured = []

    def measure(threads, precision, device="cpu", tries=3):
        measured.append(threads)
        return fake(3e11, True)

    monkeypatch.setattr(throughput, "measure_rate", measure)
    memo = throughput._rate_file(2, "fp32", "cpu")
    memo.write_text(json.dumps(fake(5e10, False)))
    first = rate_record(2, "fp32")
    assert measured == [2] and first["flops_per_second"] == 3e11 and not first["cached"]
    assert json.loads(memo.read_text())["quiet"] is True, "the quiet measurement replaces the busy one"
    again = rate_record(2, "fp32")
    assert measured == [2] and again["cached"] and again["flops_per_second"] == 3e11


def test_a_busy_new_measurement_never_replaces_a_quiet_cached_one(monkeypatch, lodger_home):
    monkeypatch.setattr(throughput, "measure_rate", lambda *a, **k: fake(5e10, False))
    memo = throughput._rate_file(2, "fp32", "cpu")
    memo.write_text(json.dumps(fake(3e11, True)))
    fresh = rate_record(2, "fp32", fresh=True)
    assert fresh["flops_per_second"] == 5e10 and not fresh["quiet"], "fresh: what the machine does now"
    assert json.loads(memo.read_text())["flops_per_second"] == 3e11


def test_a_step_that_beats_the_rate_measures_again_and_never_reports_above_one(monkeypatch, lodger_home):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))
    work = StepWork(model, rows=1, threads=1, precision="fp32", device="cpu")
    flops = work.flops(computed=100, padded=0)
    rates = iter([fake(flops / 2, False), fake(flops * 4, True)])  # cached busy rate, then the quiet one
    monkeypatch.setattr(throughput, "rate_record", lambda *a, **k: {**next(rates), "cached": True})
    monkeypatch.setattr(throughput, "measure_rate", lambda *a, **k: next(rates))
    assert work.mfu(100, 0, seconds=1.0) == 0.25, "measured again, against the quiet rate"
    assert work.take_new_rate()["reason"] == "a step beat the rate" and work.take_new_rate() is None

    stuck = StepWork(model, rows=1, threads=1, precision="fp32", device="cpu")
    monkeypatch.setattr(throughput, "rate_record", lambda *a, **k: {**fake(flops / 2, False), "cached": True})
    monkeypatch.setattr(throughput, "measure_rate", lambda *a, **k: fake(flops / 3, False))
    assert stuck.mfu(100, 0, seconds=1.0) is None, "above 100 %: left out, not shown"
    assert stuck.take_new_rate()["cached"] is True


def test_show_says_the_rate_and_how_it_was_measured():
    text = rate_text({**fake(6.1e10, False, tries=3), "cached": False})
    assert text.startswith("61.0 GFLOP/s (fp32, 2 threads, cpu) from a 0.2 s matmul benchmark at ")
    assert "measured by this run" in text and "busy: other processes used 60% of the CPUs meanwhile" in text
    assert "load average 3.50" in text and "best of 3 tries" in text
    old = rate_text({"flops_per_second": 3e11, "threads": 2, "precision": "fp32", "device": "cpu", "cached": True})
    assert "measured before lodger recorded the conditions" in old
