"""The terminal's promises: every long wait says what it does and how far it is, and no MFU above 100 %."""

from __future__ import annotations

from lodger.train.record import StepRecord
from lodger.reporting import report
from lodger.reporting.report import Phase, Reporter, _waste, eval_eta


def test_an_mfu_above_one_hundred_percent_is_never_shown():
    assert _waste(0.25, 0.277) == " | pad 25% | mfu 27.7%"
    assert "mfu" not in _waste(0.0, 1.027), "a utilisation above 100 % means a wrong peak, not a fast step"
    assert "mfu" not in _waste(None, None)


def test_the_eval_eta_counts_down_from_the_pace_of_its_batches():
    assert eval_eta(0, 6, 0.0) is None
    assert eval_eta(2, 6, 4.0) == 8.0
    assert eval_eta(2, 6, 4.0, since=3.0) == 5.0
    assert eval_eta(2, 6, 4.0, since=30.0) == 0.0
    assert eval_eta(6, 6, 9.0) == 0.0


def test_the_step_line_says_its_tokens_per_second_are_target_tokens(tmp_path):
    rep = Reporter(tmp_path / "log.txt", total=4, start=0, live=False, quiet=True)
    rep.started(0)
    rep.step(StepRecord(step=1, loss=2.5, grad_norm=1.0, lr=1e-3, tokens=160, seconds=2.0), 4, show=True,
             padding=0.0, mfu=0.4)
    rep.close()
    line = (tmp_path / "log.txt").read_text()
    assert "target tok/s 80 | pad 0% | mfu 40.0%" in line, line


def test_the_live_line_eta_counts_down_between_steps(tmp_path):
    rep = Reporter(tmp_path / "log.txt", total=10, start=0, live=False, quiet=True)
    rep.started(0)
    rep.step(StepRecord(step=1, loss=2.5, grad_norm=1.0, lr=1e-3, tokens=100, seconds=2.0), 10, show=False)
    assert rep._train_info().endswith("eta 0:18"), rep._train_info()
    step, loss, rate, when = rep.last
    rep.last = (step, loss, rate, when - 5.0)  # as if five seconds had gone by since the step
    assert rep._train_info().endswith("eta 0:13"), rep._train_info()
    rep.close()


def test_a_long_eval_without_a_terminal_says_how_far_it_is(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "EVAL_NOTE_EVERY", 0.0)
    rep = Reporter(tmp_path / "log.txt", total=4, start=0, live=False)
    rep.eval_started(0, examples=48, batches=6)
    rep.eval_progress(0, 2, 6)
    rep.eval_progress(0, 6, 6)  # the last batch: eval_finished says the rest
    rep.eval_finished(0, 3.1, 1.0)
    rep.close()
    out = capsys.readouterr().out
    assert "eval at step 0: 2/6 batches | elapsed" in out and "eta" in out, out
    assert "6/6 batches" not in out, out
    assert "eval at step 0: 2/6 batches" in (tmp_path / "log.txt").read_text()


def test_a_short_eval_without_a_terminal_prints_only_its_start_and_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "EVAL_NOTE_EVERY", 1e9)
    rep = Reporter(tmp_path / "log.txt", total=4, start=0, live=False)
    rep.eval_started(0, examples=48, batches=6)
    for done in range(1, 7):
        rep.eval_progress(0, done, 6)
    rep.eval_finished(0, 3.1, 1.0)
    rep.close()
    assert capsys.readouterr().out.count("eval at step 0") == 2


def test_the_live_line_stops_redrawing_while_the_run_is_held(tmp_path):
    rep = Reporter(tmp_path / "log.txt", total=4, start=0, live=True)
    try:
        assert rep.running.is_set()
        rep.held("user", "test")
        assert not rep.running.is_set(), "a held run's ticker must sleep (no CPU used)"
        rep.continued(1.0)
        assert rep.running.is_set()
    finally:
        rep.close()


def test_a_phase_without_a_terminal_says_what_it_does_and_how_long_it_took(capsys):
    with Phase("converting the model", expected=20, live=False, after=0.0) as phase:
        phase.advance(1, 2)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "converting the model (about 0:20) ..."
    assert out[-1].startswith("converting the model: done in ") and out[-1].endswith(" s"), out


def test_a_phase_that_ends_at_once_prints_nothing(capsys):
    with Phase("reading a cache", live=False, after=60.0):
        pass
    assert capsys.readouterr().out == ""


def test_a_phase_says_items_done_and_the_expected_time_on_its_live_line():
    phase = Phase("answering", expected=90, live=False)
    phase.began = 0.0
    phase.advance(3, 10)
    assert phase.info().startswith("3/10 | ") and phase.info().endswith(" of about 1:30"), phase.info()


def test_a_run_starting_ends_the_phase_that_waited_for_it(tmp_path, capsys):
    with Phase("loading the model and starting the run", live=False, after=0.0) as phase:
        rep = Reporter(tmp_path / "log.txt", total=2, start=0, live=False)
        assert phase.ended, "the run's lines take over from the phase"
        rep.message("run x: starting at step 0/2")
        rep.close()
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("loading the model and starting the run: done in ") and out[2].startswith("run x"), out
