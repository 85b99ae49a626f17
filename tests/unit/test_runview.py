"""runview: the live step from the end of metrics.jsonl, and tables that never cut a run id."""

from __future__ import annotations

import json

from lodger.lifecycle.runview import TAIL_BYTES, newest_records, progress, step_text, table


def write_metrics(path, records, torn: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn)


def test_the_newest_train_and_eval_records_are_found_past_a_torn_last_line(tmp_path):
    records = [{"kind": "train", "step": s, "loss": 1.0 / s} for s in range(1, 6)]
    records.insert(4, {"kind": "eval", "step": 4, "eval_loss": 0.5})
    write_metrics(tmp_path / "metrics.jsonl", records, torn='{"kind": "train", "st')
    train, evaluation = newest_records(tmp_path)
    assert train["step"] == 5 and evaluation["step"] == 4


def test_a_long_metrics_file_is_read_only_from_its_end(tmp_path):
    records = [{"kind": "train", "step": s, "loss": 0.25, "pad": "x" * 200} for s in range(1, 2001)]
    write_metrics(tmp_path / "metrics.jsonl", records)
    assert (tmp_path / "metrics.jsonl").stat().st_size > 4 * TAIL_BYTES
    train, evaluation = newest_records(tmp_path)
    assert train["step"] == 2000 and evaluation is None


def test_progress_names_the_checkpoint_step_when_the_run_is_further_on(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", [{"kind": "train", "step": 14, "loss": 0.123456}])
    run = {"step": 12, "total_steps": 24, "loss": 0.2}
    info = progress(run, tmp_path)
    assert (info["step"], info["checkpoint_step"], info["loss"]) == (14, 12, 0.123456)
    assert step_text(info) == "14/24 (ckpt 12)"
    assert step_text(progress({"step": 24, "total_steps": 24, "loss": 0.1}, tmp_path / "none")) == "24/24"


def test_a_narrow_table_drops_columns_but_never_cuts_the_id():
    run_id = "a-rather-long-experiment-name-20261130-223201-ab12"
    lines = table([[run_id, "running", "14/24", "0.1234", "smollm2", "lora", "2026-11-30 22:32"]],
                  ["run", "status", "step", "loss", "model", "method", "started"], width=40)
    assert lines[1].split()[:2] == [run_id, "running"]
    assert "started" not in lines[0]
    wide = table([[run_id, "running", "14/24"]], ["run", "status", "step"], width=None)
    assert wide[1].split() == [run_id, "running", "14/24"]
