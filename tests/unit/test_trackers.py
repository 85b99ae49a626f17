"""`lodger report`: what TensorBoard's own reader and MLflow's own client read back is the ledger's
run, every step once, also after the ledger replaced steps (a kill, then a resume that redid them)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from lodger.ledger import Ledger
from lodger.ledger.values import NewRun
from lodger.reporting.trackers import export

JOB = '[method]\nkind = "lora"\nrank = 8\n[training]\nsteps = 8\nlearning_rate = 0.001\n'


def _train(step: int, shift: float = 0.0) -> dict:
    return {"kind": "train", "step": step, "loss": 3.0 / step + shift, "lr": 0.001, "tokens_per_s": 100.0 + step,
            "reward/format": 0.25 * step, "time": 1_800_000_000.0 + step}


@pytest.fixture
def killed_and_resumed(lodger_home):
    """A run whose steps 1-6 were committed, then 5-6 lost with the process and redone (other values)."""
    with Ledger() as ledger:
        ledger.create_run(NewRun("job-1", "job", "/models/tiny", "lora", "h", JOB, 8))
        ledger.add_provenance("job-1", 0, {"host": "here", "lodger_version": "0.1.0", "model": {"sha256": "ab"}})
        ledger.add_metrics("job-1", 0, [_train(s) for s in range(1, 7)] +
                           [{"kind": "eval", "step": 4, "eval_loss": 2.5, "time": 1_800_000_004.5}])
    return lodger_home


def _redo(steps: range, shift: float) -> None:
    with Ledger() as ledger:
        ledger.truncate_metrics("job-1", steps.start - 1)
        ledger.add_metrics("job-1", 1, [_train(s, shift) for s in steps])
        ledger.set_status("job-1", "finished", "finished", step=steps.stop - 1)


def _ledger_points(name: str, kind: str = "train") -> list[tuple[int, float]]:
    with Ledger() as ledger:
        return [(r["step"], r[name]) for r in ledger.metrics("job-1", kind)]


def test_tensorboard_reads_every_step_once_with_the_ledgers_values_after_a_resume(killed_and_resumed, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert export("job-1", ["tensorboard"], tmp_path)[0][1]
    _redo(range(5, 9), shift=0.125)
    (result,) = export("job-1", ["tensorboard"], tmp_path)
    assert result[1], result
    reader = EventAccumulator(str(tmp_path / "tensorboard" / "job-1"))
    reader.Reload()
    for name, kind in (("loss", "train"), ("reward/format", "train"), ("eval_loss", "eval")):
        read = [(e.step, e.value) for e in reader.Scalars(name)]
        expected = _ledger_points(name, kind)
        assert [s for s, _ in read] == [s for s, _ in expected], f"{name}: every step once"
        # TensorBoard keeps float32
        assert all(math.isclose(a, b, rel_tol=1e-6) for (_, a), (_, b) in zip(read, expected)), name
    texts = reader.Tags()["tensors"]
    assert any(t.startswith("job") for t in texts) and any(t.startswith("provenance") for t in texts), texts


def test_mlflow_reads_every_step_once_appends_what_is_new_and_rewrites_what_the_ledger_replaced(killed_and_resumed,
                                                                                               tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert export("job-1", ["mlflow"], uri=uri)[0][1]
    with Ledger() as ledger:  # two more steps, nothing replaced: appended to the same MLflow run
        ledger.add_metrics("job-1", 0, [_train(7), _train(8)])
    (_, worked, message) = export("job-1", ["mlflow"], uri=uri)[0]
    assert worked and "8 new values" in message, message  # steps 7 and 8: loss, lr, tokens_per_s, reward/format
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("lodger").experiment_id
    (first,) = client.search_runs([experiment], "tags.`lodger.run_id` = 'job-1'")
    _redo(range(5, 9), shift=0.125)
    (_, worked, message) = export("job-1", ["mlflow"], uri=uri)[0]
    assert worked and "written again" in message, message
    (run,) = client.search_runs([experiment], "tags.`lodger.run_id` = 'job-1'")
    assert run.info.run_id != first.info.run_id and run.info.status == "FINISHED"
    for name, kind in (("loss", "train"), ("reward/format", "train"), ("eval_loss", "eval")):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        assert history == _ledger_points(name, kind), name
    assert run.data.params["method.rank"] == "8" and run.data.params["training.learning_rate"] == "0.001"
    assert run.data.tags["lodger.host"] == "here"
    with Ledger() as ledger:
        kinds = [e["kind"] for e in ledger.events("job-1") if e["kind"].startswith("tracker_")]
    assert kinds == ["tracker_export"] * 3


def test_a_tracker_that_fails_is_a_warning_and_an_event_and_the_others_are_written(killed_and_resumed, tmp_path):
    (tmp_path / "not-a-folder").write_text("a file where the store's folder should be")
    results = export("job-1", ["mlflow", "tensorboard"], tmp_path, uri=f"sqlite:///{tmp_path}/not-a-folder/x.db")
    assert [(t, worked) for t, worked, _ in results] == [("mlflow", False), ("tensorboard", True)], results
    with Ledger() as ledger:
        failed = ledger.last_event("job-1", "tracker_failed")
    assert failed and failed["data"]["tracker"] == "mlflow"


_TRACKIO = """
import json, sys
from pathlib import Path
from lodger.reporting.trackers import export
folder = Path(sys.argv[1])
result = export("job-1", ["trackio"], folder)
from trackio.sqlite_storage import SQLiteStorage  # Trackio's own reader of its store
print(json.dumps({"result": result, "logs": SQLiteStorage.get_logs("lodger", "job-1"),
                  "runs": SQLiteStorage.get_runs("lodger")}, default=str))
"""


def _trackio(folder) -> dict:
    """Export to Trackio and read its store back in a fresh interpreter: Trackio fixes its folder
    when it is first imported, and this test process may have imported it already (TRL does)."""
    done = subprocess.run([sys.executable, "-c", _TRACKIO, str(folder)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TRACKIO_DIR": str(folder / "trackio")})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_trackio_reads_every_step_once_with_the_ledgers_values_after_a_resume(killed_and_resumed, tmp_path):
    first = _trackio(tmp_path)  # sent while steps 5-6 were the first process's
    assert first["result"][0][1], first["result"]
    _redo(range(5, 9), shift=0.5)
    second = _trackio(tmp_path)
    assert second["result"][0][1], second["result"]
    logs = second["logs"]
    got = [(row["step"], row["loss"]) for row in logs if "loss" in row]
    assert got == _ledger_points("loss")  # steps 1-8 once each, 5-6 with the redone values
    assert [(row["step"], row["eval_loss"]) for row in logs if "eval_loss" in row] == _ledger_points("eval_loss", "eval")
    assert second["runs"] == ["job-1"]
