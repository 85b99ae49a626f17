"""Commands for runs on a remote target: sync, cancel (and the hidden remote worker).

`lodger submit` (cli/remote.py) sends a job; `status`, `show`, `logs`, `pause` and `resume`
work on remote runs as on local ones. Ray is imported only where Ray is asked something.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import RunStateError


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def sync(run_id: str, as_json: bool) -> None:
    """Bring a remote RUN's checkpoints, metrics, log and events home, and ask Ray how its job is.

    Only committed checkpoints that verify against their manifest are copied. `show`, `status`
    and `ls` do the same for every remote run not ended (asking Ray for 2 s at most); `sync`
    waits longer for Ray. A job that Ray says ended without the run saying so (killed, lost
    node) is recorded as crashed.

    Example: lodger sync my-job-20261129-101500-ab12
    """
    from ..home import run_dir
    from ..ledger import Ledger
    from ..remote import RemoteError, is_remote, job_status
    from ..remote.live import settle
    from ..remote.sync import sync as sync_run

    with Ledger() as ledger:
        run = ledger.find_run(run_id)
        if not is_remote(run):
            raise RunStateError(f"run {run['id']} runs on this machine; there is nothing to sync")
        try:
            ray_status, message = job_status(run)  # asked first: an ended job has written all it will
        except RemoteError as exc:
            ray_status, message = None, str(exc)
        run = settle(ledger, sync_run(ledger, run), ray_status, message)
    folder = run_dir(run["id"])
    checkpoints = sorted(p.name for p in (folder / "checkpoints").glob("step-*")) if folder.exists() else []
    info = {"id": run["id"], "status": run["status"], "step": run["step"], "total_steps": run["total_steps"],
            "target": run["target"], "submission_id": run["remote_job_id"], "ray_status": ray_status,
            "ray_message": message, "checkpoints": checkpoints, "adapter": (folder / "adapter").is_dir()}
    if as_json:
        click.echo(json.dumps(info, indent=1))
        return
    click.echo(f"{run['id']}: {run['status']} at step {run['step']}/{run['total_steps']} on {run['target']} "
               f"(Ray: {ray_status or message}); checkpoints here: {', '.join(checkpoints) or 'none yet'}")


@click.command()
@click.argument("run_id", metavar="RUN")
def cancel(run_id: str) -> None:
    """Stop a remote RUN's Ray job and mark the run cancelled.

    Ray sends the job SIGTERM (it commits a checkpoint at the next step if it has time) and kills
    it a few seconds later. A cancelled run is not resumed; submit the job again instead. To stop
    a run you mean to continue, use `lodger pause RUN`.

    Example: lodger cancel my-job-20261129-101500-ab12
    """
    from ..remote.executors import executor_for
    from ..ledger import Ledger

    with Ledger() as ledger:
        run = ledger.find_run(run_id)
        was_running = executor_for(run).cancel(ledger, run)  # a local run is refused: pause stops it
    click.echo(f"run {run['id']} cancelled" + (" (its Ray job was told to stop)" if was_running else ""))


@click.command(name="_remote_worker", hidden=True)
@click.argument("run_id")
@click.argument("job", type=click.Path(dir_okay=False, path_type=Path))
def remote_worker(run_id: str, job: Path) -> None:
    """Train RUN inside a Ray job (LODGER_HOME is the run's home in storage): start or resume it."""
    from ..lifecycle.jobfile import load_job
    from ..remote import raytrain
    from ..remote.worker import start
    from .crash import log_to_run

    log_to_run(run_id)  # the run's log.txt is synced back; Ray's job log is not read by the owner
    if raytrain.wanted(load_job(job)):  # more than one node: one Ray Train worker per rank
        raytrain.start(run_id, job)
    else:
        start(run_id, job)


COMMANDS = [sync, cancel, remote_worker]
