"""A job's `[report] to` feeds its trackers while it trains: a run killed while writing its second
checkpoint (the steps after the first were lost with it) and resumed to the end leaves TensorBoard
and Trackio, read by their own readers, holding every step once with the ledger's values, as
metrics.jsonl has them; the exports are recorded in the ledger."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from helpers import (describe, event_kinds, killed_by_sigkill, lodger_env, read_metrics, run_dir_of, run_lodger, show,
                     write_job)


def test_a_killed_and_resumed_run_feeds_tensorboard_and_trackio_every_step_once(tmp_path, tiny_model_dir, chat_data):
    trackers = tmp_path / "trackers"
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=chat_data["train"], eval=chat_data["eval"],
                    steps=8, every_steps=3, eval_every=4,
                    extra={"report": {"to": ["tensorboard", "trackio"], "dir": str(trackers)}})
    env = lodger_env(tmp_path / "home")
    died = run_lodger(["run", job, "--quiet"], {**env, "LODGER_FAULT": "before_rename@2"})
    assert killed_by_sigkill(died.returncode), describe(died)
    run_id = died.stdout.splitlines()[0].split()[1]
    finished = run_lodger(["resume", run_id], env)
    assert finished.returncode == 0, describe(finished)
    folder = run_dir_of(run_id, env)
    lines = read_metrics(folder)
    expected = {kind: [(r["step"], r[key]) for r in lines if r["kind"] == kind]
                for kind, key in (("train", "loss"), ("eval", "eval_loss"))}
    assert [s for s, _ in expected["train"]] == list(range(1, 9))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(trackers / "tensorboard" / run_id))
    reader.Reload()
    for name, kind in (("loss", "train"), ("eval_loss", "eval")):
        read = [(e.step, e.value) for e in reader.Scalars(name)]
        assert [s for s, _ in read] == [s for s, _ in expected[kind]], f"tensorboard {name}: every step once"
        assert all(math.isclose(a, b, rel_tol=1e-6) for (_, a), (_, b) in zip(read, expected[kind]))  # float32 there

    # Trackio's own reader, in a process of its own (its store's folder is fixed when it is imported)
    code = ("import json, trackio.sqlite_storage as s; "
            f"print(json.dumps([(r['step'], r.get('loss'), r.get('eval_loss')) for r in s.SQLiteStorage.get_logs("
            f"'lodger', {run_id!r})]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "TRACKIO_DIR": str(trackers / "trackio")}).stdout
    rows = json.loads(out.strip().splitlines()[-1])
    assert [(s, v) for s, v, _ in rows if v is not None] == expected["train"]
    assert [(s, v) for s, _, v in rows if v is not None] == expected["eval"]
    kinds = event_kinds(show(run_id, env))
    assert "tracker_export" in kinds and "tracker_failed" not in kinds
