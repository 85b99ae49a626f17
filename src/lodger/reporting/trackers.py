"""A run's numbers where TensorBoard, MLflow and Trackio read them, from what the ledger committed.

The ledger stays the truth; a tracker is a copy made from it: every train and eval record the
ledger holds (each numeric field under its metrics.jsonl name), the job's hyper-parameters and the
run's provenance. A step the ledger replaced (a run killed after its last checkpoint redoes the
steps after it, and the ledger keeps only the redone ones) is replaced in the tracker too, never
added beside the first:

- TensorBoard: the run's folder of event files is written whole into a new folder at each
  export, which then takes the old one's place (an event file can only be appended to).
- MLflow: the run tagged ``lodger.run_id`` gets only the steps after its last one while what it
  holds is the ledger's; when the ledger has replaced a step it holds, that MLflow run is deleted
  and written again.
- Trackio (TRL's recommended tracker, local-first): its run named after lodger's is deleted and
  logged again whole at each export, in its own SQLite store under ``$LODGER_HOME/trackers/
  trackio`` (``TRACKIO_DIR``), which `trackio show` serves.

Writers: tensorboardX (protobuf and numpy, no torch or TensorFlow), mlflow-skinny on a local
SQLite store by default, and trackio. All optional (`pip install 'lodger[trackers]'`). A job's
`[report] to` sends its run after every checkpoint while it trains (reporting/feed.py).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .compare import flatten
from ..errors import LodgerError
from ..home import home
from ..ledger import Ledger

TRACKERS = ("tensorboard", "mlflow", "trackio")
SKIPPED = ("kind", "step", "time", "segment")
MLFLOW_BATCH = 1000  # MLflow takes at most 1000 metrics in one log_batch


@dataclass
class RunRecord:
    """What a tracker is given: one run as the ledger holds it."""

    run: dict
    job: dict
    provenance: list[dict]
    records: list[dict]  # train and eval records in step order

    def points(self) -> dict[str, list[tuple[int, float, float]]]:
        """{field: [(step, value, time)]} of every finite number the records carry."""
        found: dict[str, list[tuple[int, float, float]]] = {}
        for r in self.records:
            for key, value in r.items():
                if key in SKIPPED or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if math.isfinite(value):
                    found.setdefault(key, []).append((int(r["step"]), float(value), float(r.get("time") or 0.0)))
        return found


def load(ledger: Ledger, run_id: str) -> RunRecord:
    run = ledger.find_run(run_id)
    records = sorted(ledger.metrics(run["id"], "train") + ledger.metrics(run["id"], "eval"),
                     key=lambda r: (r["step"], r.get("kind") == "eval"))
    return RunRecord(run, tomllib.loads(run["job_toml"]), ledger.provenance(run["id"]), records)


def flat_job(job: dict, prefix: str = "") -> dict[str, str]:
    """The job's keys flattened (`training.learning_rate`), each value as a tracker's parameter text."""
    return {name: json.dumps(value) if isinstance(value, (list, bool)) or value is None else str(value)
            for name, value in flatten(job, prefix).items()}


def default_folder() -> Path:
    return home() / "trackers"


def to_tensorboard(record: RunRecord, folder: Path) -> str:
    """Write the run's event files into ``folder/<run id>``, replacing what an earlier export wrote."""
    from tensorboardX import SummaryWriter

    from .. import durable

    final = durable.make_dirs(Path(folder)) / record.run["id"]
    fresh = final.with_name(f".{final.name}.tmp-{secrets.token_hex(3)}")
    writer = SummaryWriter(str(fresh))
    try:
        for name, points in record.points().items():
            for step, value, at in points:
                writer.add_scalar(name, value, step, walltime=at or None)
        writer.add_text("job", "```toml\n" + record.run["job_toml"] + "\n```", 0)
        writer.add_text("provenance", "```json\n" + json.dumps(record.provenance, indent=1, default=str) + "\n```", 0)
    finally:
        writer.close()
    old = final.with_name(f".{final.name}.old-{secrets.token_hex(3)}")
    durable.sync_tree(fresh)  # tensorboardX does not fsync; the event says these values are there
    if final.exists():
        durable.rename(final, old)
    durable.rename(fresh, final)
    durable.fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)  # the replaced copy: back after a cut, it is a hidden leftover
    return f"tensorboard: {sum(len(p) for p in record.points().values())} values in {final} " \
           f"(tensorboard --logdir {final.parent})"


def mlflow_uri(given: str | None) -> str:
    if given:
        return given
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    default_folder().mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{default_folder() / 'mlflow.db'}"


def to_mlflow(record: RunRecord, uri: str, experiment: str = "lodger") -> str:
    """Log the run into MLflow at ``uri``: appended to the run that holds its earlier steps, or
    written again when the ledger replaced one of them."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(
        experiment, artifact_location=str(default_folder() / "mlflow-artifacts") if uri.startswith("sqlite") else None)
    run_id = record.run["id"]
    points = record.points()
    existing = client.search_runs([experiment_id], f"tags.`lodger.run_id` = '{run_id}'")
    target, after = None, -1
    for old in existing:
        held = {name: [(m.step, m.value) for m in client.get_metric_history(old.info.run_id, name)] for name in points}
        last = max((s for pairs in held.values() for s, _ in pairs), default=-1)
        if target is None and all(pairs == [(s, v) for s, v, _ in points[name] if s <= last]
                                  for name, pairs in held.items()):
            target, after = old.info.run_id, last
        else:  # it holds a step the ledger no longer has as it was: written again below
            client.delete_run(old.info.run_id)
    replaced = bool(existing) and target is None
    if target is None:
        target = client.create_run(experiment_id, run_name=run_id, tags={"lodger.run_id": run_id}).info.run_id
        params = [Param(k[:250], v[:6000]) for k, v in flat_job(record.job).items()]
        client.log_batch(target, params=params[:100])
        for start in range(100, len(params), 100):
            client.log_batch(target, params=params[start:start + 100])
        client.log_dict(target, {"segments": record.provenance}, "provenance.json")
    newest = record.provenance[-1] if record.provenance else {}
    tags = {"lodger.status": record.run["status"], "lodger.model_sha256": (newest.get("model") or {}).get("sha256"),
            "lodger.host": newest.get("host"), "lodger.version": newest.get("lodger_version")}
    client.log_batch(target, tags=[RunTag(k, str(v)) for k, v in tags.items() if v is not None])
    metrics = [Metric(name, value, int(at * 1000), step) for name, pairs in points.items()
               for step, value, at in pairs if step > after]
    for start in range(0, len(metrics), MLFLOW_BATCH):
        client.log_batch(target, metrics=metrics[start:start + MLFLOW_BATCH])
    if record.run["status"] in ("finished", "failed"):
        client.set_terminated(target, "FINISHED" if record.run["status"] == "finished" else "FAILED")
    how = "written again (the ledger replaced steps it held)" if replaced else \
        f"{len(metrics)} new values" if after >= 0 else f"{len(metrics)} values"
    return f"mlflow: run {target} in experiment {experiment!r} at {uri}: {how}"


def to_trackio(record: RunRecord, folder: Path, project: str = "lodger") -> str:
    """Log the run into Trackio's store in ``folder`` (its TRACKIO_DIR), replacing what an earlier
    export of it logged: Trackio appends only, so a replaced step could otherwise show twice."""
    os.environ["TRACKIO_DIR"] = str(folder)  # read when trackio is first imported
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    from .. import durable

    durable.make_dirs(Path(folder))
    if Path(trackio.TRACKIO_DIR) != Path(folder):
        raise LodgerError(f"trackio was imported with TRACKIO_DIR={trackio.TRACKIO_DIR}, not {folder}")
    name = record.run["id"]
    if name in SQLiteStorage.get_runs(project):
        SQLiteStorage.delete_run(project, name)
    trackio.init(project=project, name=name, config=flat_job(record.job), resume="never", embed=False,
                 auto_log_cpu=False, auto_log_gpu=False)
    steps: dict[int, dict[str, float]] = {}
    for field, points in record.points().items():
        for step, value, _ in points:
            steps.setdefault(step, {})[field] = value
    try:
        for step in sorted(steps):
            trackio.log(steps[step], step=step)
    finally:
        trackio.finish()  # flushes its batching thread into the store
    return f"trackio: {sum(len(v) for v in steps.values())} values in project {project!r} at {folder} " \
           f"(TRACKIO_DIR={folder} trackio show)"


def export(run_id: str, to: list[str], folder: Path | None = None,
           uri: str | None = None) -> list[tuple[str, bool, str]]:
    """Send ``run_id`` to each tracker in ``to``: [(tracker, worked, what it did or its error)].
    Each outcome is also an event in the ledger; one tracker failing stops no other."""
    unknown = [t for t in to if t not in TRACKERS]
    if unknown:
        raise LodgerError(f"--to {','.join(unknown)}: lodger writes to {', '.join(TRACKERS)}")
    with Ledger() as ledger:
        record = load(ledger, run_id)
    results = []
    for tracker in to:
        try:
            if tracker == "tensorboard":
                done = to_tensorboard(record, Path(folder or default_folder()) / "tensorboard")
            elif tracker == "trackio":
                done = to_trackio(record, Path(folder or default_folder()) / "trackio")
            else:
                done = to_mlflow(record, mlflow_uri(uri))
            results.append((tracker, True, done))
        except ImportError as exc:
            results.append((tracker, False, f"{exc}: pip install 'lodger[trackers]'"))
        except Exception as exc:  # the tracker's own failure (a disk, a URI): said and recorded, never fatal
            results.append((tracker, False, f"{type(exc).__name__}: {exc}"))
        _, worked, message = results[-1]
        with Ledger() as ledger:
            ledger.event(record.run["id"], "tracker_export" if worked else "tracker_failed", tracker=tracker,
                         steps=len(record.records), message=message)
    return results
