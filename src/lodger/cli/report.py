"""`lodger report`: a run's numbers into TensorBoard, MLflow or Trackio (reporting/trackers.py)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from ..errors import LodgerError


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option("--to", "to", default="tensorboard", show_default=True,
              help="Trackers, comma-separated: tensorboard, mlflow, trackio.")
@click.option("--dir", "folder", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where TensorBoard's event files (one folder per run under tensorboard/) and Trackio's store "
                   "(trackio/) go (default $LODGER_HOME/trackers).")
@click.option("--mlflow-uri", default=None,
              help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else sqlite:///$LODGER_HOME/trackers/mlflow.db).")
@click.option("--follow", is_flag=True, help="Keep sending what the ledger commits while the run trains (every 10 s).")
def report(run_id: str, to: str, folder: Path | None, mlflow_uri: str | None, follow: bool) -> None:
    """Send RUN's steps, evals, hyper-parameters and provenance to TensorBoard, MLflow and/or Trackio.

    Written from what the ledger committed, so after a kill and resume every step appears once,
    with the ledger's values; send again at any time (docs/ui.md says how each tracker is kept so).
    A tracker that fails is a warning and a `tracker_failed` event, and the exit code is 1.

    A job's `[report] to = ["tensorboard", ...]` does this after every checkpoint while it trains.

    \b
    Example: lodger report my-job-20261129-101500-ab12 --to tensorboard,mlflow,trackio
             tensorboard --logdir ~/.lodger/trackers/tensorboard
             TRACKIO_DIR=~/.lodger/trackers/trackio trackio show
    """
    from ..home import run_dir
    from ..ledger import Ledger
    from ..owner.runlock import is_locked
    from ..reporting.trackers import export

    trackers = [t.strip() for t in to.split(",") if t.strip()]
    with Ledger() as ledger:
        run = ledger.find_run(run_id)
    while True:
        results = export(run["id"], trackers, folder, mlflow_uri)
        for tracker, worked, message in results:
            click.echo(message if worked else f"warning: {tracker}: {message}", err=not worked)
        if not follow or not is_locked(run_dir(run["id"])):
            break
        time.sleep(10)  # the ledger commits at checkpoints: seconds apart at the least
    if not all(worked for _, worked, _ in results):
        raise LodgerError("some trackers were not written; see the warnings above")


COMMANDS = [report]
