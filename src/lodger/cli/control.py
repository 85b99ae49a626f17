"""Commands that give the machine back or show who has it: pause, status (and the hidden worker)."""

from __future__ import annotations

import json
import time

import click

from ..errors import LodgerError, RunStateError


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
    from ..control import process_state, request_pause, run_state
    from ..home import run_dir
    from ..ledger import Ledger
    from ..runlock import holder, is_locked

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
            if run.get("target"):  # on a remote target: its backend asks it (a request file in storage)
                from ..remote import pause as pause_remote

                waiting.append((run, pause_remote(ledger, run, mode), None, time.time()))
                continue
            folder = run_dir(run["id"])
            try:
                asked = request_pause(folder, mode, ledger)
            except RunStateError as exc:
                raise RunStateError(f"{exc} (status {run['status']})") from None
            if asked.note(run["id"], mode):
                click.echo(asked.note(run["id"], mode))
            waiting.append((run, folder, asked.pid, time.time()))
    if no_wait:
        click.echo(f"asked {len(waiting)} run(s) to {mode}")
        return
    for run, folder, pid, asked in waiting:
        while time.monotonic() - started < timeout:
            if pid is not None and process_state(pid) in ("T", "t"):
                raise RunStateError(f"run {run['id']}: its process {pid} is stopped and cannot {mode} until it is "
                                    "continued (Ctrl-Z, SIGSTOP, or `stty tostop` stopping a background process "
                                    f"that writes to its terminal); the request stands: `fg` it in its terminal, or "
                                    f"`kill -CONT {pid}`")
            if hold:
                state = run_state(folder)
                if state.get("state") == "held" and state.get("time", 0) >= asked - 1:
                    click.echo(f"{run['id']}: held at step {state.get('step')} "
                               f"({time.monotonic() - started:.2f} s); `lodger resume {run['id']}` continues")
                    break
            elif pid is None:  # remote: the run answers in its state file when it has stopped
                from ..remote import answered_state

                state = answered_state(run, folder)
                if state.get("state") in ("paused", "interrupted", "finished") and state.get("time", 0) >= asked - 1:
                    click.echo(f"{run['id']}: {state['state']} at step {state.get('step')} on {run['target']} "
                               f"({time.monotonic() - started:.2f} s)")
                    break
            elif not is_locked(folder) and not _alive(pid):
                # The lock goes before the process: "memory freed" only once the process is gone too.
                state = run_state(folder)
                click.echo(f"{run['id']}: paused at step {state.get('step')}, checkpoint committed, memory freed "
                           f"({time.monotonic() - started:.2f} s)")
                break
            time.sleep(0.02)
        else:
            raise LodgerError(f"run {run['id']} did not {mode} within {timeout:.0f} s")


def _alive(pid: int) -> bool:
    """Whether ``pid`` still exists as a process that has not exited (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (exact numbers).")
def status(as_json: bool) -> None:
    """What is training, held, paused or queued, and whether the agent is running.

    Example: lodger status
    """
    from ..agent import agent_pid
    from ..control import read_requests
    from ..home import run_dir
    from ..ledger import Ledger
    from ..runview import loss_text, progress, step_text
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
        folder = run_dir(run["id"])
        if run.get("target"):
            from ..remote import remote_run_dir

            folder = remote_run_dir(run)
        requests = {k: v.get("state") for k, v in read_requests(folder).items()}
        now = progress(run, folder)
        rows.append({"id": run["id"], "status": state, "step": now["step"], "checkpoint_step": now["checkpoint_step"],
                     "total_steps": run["total_steps"], "loss": now["loss"], "managed": bool(run.get("managed")),
                     "requests": requests, "target": run.get("target"),
                     "cluster_unreachable": stale.get(run["id"])})
    info = {"agent_pid": agent_pid(), "runs": rows, "queue": queue, "federated": federated}
    if as_json:
        click.echo(json.dumps(info, indent=1, default=str))
        return
    click.echo(f"agent: {'running (pid %d)' % info['agent_pid'] if info['agent_pid'] else 'not running'}")
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
    from ..restarts import mark_starting
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
    from ..jobfile import load_job
    from ..home import run_dir
    from ..lifecycle.prepare import JOB_FILE

    return load_job(run_dir(run_id) / JOB_FILE).training.world_size


COMMANDS = [pause, status, worker]
