"""Commands that give the machine back or show who has it: pause, status (and the hidden worker)."""

from __future__ import annotations

import json
import time

import click



@click.command()
@click.argument("run_ids", metavar="[RUN]...", nargs=-1)
@click.option("--hold", is_flag=True, help="Stop at the next layer and keep memory (no CPU) instead of "
                                            "checkpointing and exiting.")
@click.option("--all", "all_runs", is_flag=True, help="Every run that is training now.")
@click.option("--no-wait", is_flag=True, help="Return at once instead of waiting until the machine is free.")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds to wait at most.")
def pause(run_ids: tuple[str, ...], hold: bool, all_runs: bool, no_wait: bool, timeout: float) -> None:
    """Give the machine back: checkpoint at once and exit (default), or hold in memory (--hold).

    A release drops the current step's partial work, commits a checkpoint and exits, freeing all
    memory; a hold stops where it is (before the next transformer layer, forward or backward) and
    sleeps. Both answer within one layer's compute. `lodger resume RUN` continues either kind, and
    neither changes the result.

    \b
    Example: lodger pause my-job-20261129-101500-ab12 --hold
             lodger pause --all
    """
    from ..remote.executors import executor_for, wait_answered
    from ..home import run_dir
    from ..ledger import Ledger
    from ..owner.runlock import holder

    mode = "hold" if hold else "release"
    with Ledger() as ledger:
        if all_runs:
            targets = [r for r in ledger.runs() if holder(run_dir(r["id"]))]
            if not targets:
                click.echo("nothing is training")
                return
        elif run_ids:
            targets = [ledger.find_run(r) for r in run_ids]
        else:
            raise click.UsageError("name a RUN, or pass --all")
        started = time.monotonic()
        waiting = []
        for run in targets:
            asked = executor_for(run).pause(ledger, run, mode)
            if asked.note:
                click.echo(asked.note)
            waiting.append(asked)
    if no_wait:
        click.echo(f"asked {len(waiting)} run(s) to {mode}")
        return
    for asked in waiting:
        click.echo(wait_answered(asked, hold, started, timeout))


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (exact numbers).")
def status(as_json: bool) -> None:
    """What is training, held, paused or queued, and whether the agent is running.

    Example: lodger status
    """
    from ..owner.agent import agent_pid
    from ..owner.control import read_requests
    from ..remote.executors import executor_for
    from ..ledger import Ledger
    from ..lifecycle.runview import loss_text, progress, step_text
    from .runs import live_status, refresh_remote

    with Ledger() as ledger:
        runs = [r for r in ledger.runs() if r["status"] not in ("finished", "failed", "cancelled")]
        runs, stale = refresh_remote(ledger, runs)  # remote runs: storage, and Ray for 2 s at most
        queue = ledger.queue()
        from ..federated.owner import participation  # no torch, no flwr: the ledger's federated events

        federated = participation(ledger)
    rows = []
    for run in runs:
        state = live_status(run)
        folder = executor_for(run).folder(run)  # a remote run's files straight from storage
        requests = {k: v.get("state") for k, v in read_requests(folder).items()}
        now = progress(run, folder)
        rows.append({"id": run["id"], "status": state, "step": now["step"], "checkpoint_step": now["checkpoint_step"],
                     "total_steps": run["total_steps"], "loss": now["loss"], "managed": bool(run.get("managed")),
                     "requests": requests, "target": run.get("target"),
                     "cluster_unreachable": stale.get(run["id"])})
    pid = agent_pid()
    info = {"agent_pid": pid, "runs": rows, "queue": queue, "federated": federated}
    if as_json:
        click.echo(json.dumps(info, indent=1, default=str))
        return
    click.echo(f"agent: {'running (pid %d)' % pid if pid else 'not running'}")
    if not rows and not queue and not federated:
        click.echo("nothing running, paused or queued")
    for r in rows:
        extra = ", ".join(f"{k}:{v}" for k, v in r["requests"].items())
        click.echo(f"{r['status']:<12} {r['id']}  step {step_text(r)}  loss {loss_text(r['loss'])}"
                   + (f"  on {r['target']}" if r["target"] else "") + (f"  [{extra}]" if extra else "")
                   + ("  (as last synced: cluster unreachable)" if r["cluster_unreachable"] else ""))
    for q in queue:
        click.echo(f"{'queued':<12} #{q['id']} {q['name']}  priority {q['priority']}")
    for f in federated:
        _federated_line(f)


def _federated_line(f: dict) -> None:
    """One federated job this machine takes part in: rounds taken, the last, declined ones and why."""
    last = f"last round {f['last_round']}" if f["last_round"] is not None else "no round yet"
    declined = f["last_declined"]
    why = f" (last: round {declined['round']}: {declined['reason']})" if declined else ""
    click.echo(f"{'federated':<12} {f['participation']}{'  HELD by the owner' if f['held'] else ''}  server "
               f"{f['server'] or '-'}  {f['rounds']} round(s) taken, {last}; {f['declined']} declined{why}")


@click.command(name="_worker", hidden=True)
@click.argument("run_id")
@click.option("--fresh", is_flag=True)
@click.option("--threads", type=click.IntRange(1, 1024))
@click.option("--world-size", type=click.IntRange(1, 1024))
@click.option("--quiet/--no-quiet", default=True)
def worker(run_id: str, fresh: bool, threads: int | None, world_size: int | None, quiet: bool) -> None:
    """Train RUN in this (detached) process, or as one rank under torchrun; used by --detach and the agent."""
    from ..distributed import inside_launch
    from ..home import run_dir
    from ..lifecycle.run import Run
    from ..owner.restarts import mark_starting
    from .crash import log_to_run

    log_to_run(run_id)  # nobody watches this process's stderr: a crash must reach the run's log
    mark_starting(run_dir(run_id))  # until it holds the run lock, the agent must not start it beside us
    # One process training alone takes the run at once (--detach returns when it has); with
    # several ranks, rank 0 (a grandchild of this process) takes it.
    run = Run(run_id)
    if not inside_launch() and (world_size or _job_world_size(run_id)) == 1:
        run.take()
    run.reopen(threads, world_size)
    run.start(resuming=not fresh, quiet=quiet)


def _job_world_size(run_id: str) -> int:
    from ..lifecycle.jobfile import load_job
    from ..home import run_dir
    from ..lifecycle.prepare import JOB_FILE

    return load_job(run_dir(run_id) / JOB_FILE).training.world_size


COMMANDS = [pause, status, worker]
