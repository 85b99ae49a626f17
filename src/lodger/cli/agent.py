"""The agent and its queue: agent, queue add/ls/rm (and the hidden starter of queued jobs)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import LodgerError


@click.command()
@click.option("--interval", type=click.FloatRange(0.05), default=1.0, show_default=True,
              help="Seconds between looks at the machine.")
@click.option("--max-concurrent", type=click.IntRange(1), default=None,
              help="Runs side by side at most (default: [agent] max_concurrent in config.toml, else 1).")
@click.option("--for-seconds", type=float, default=None, help="Stop after this long (for scripts and tests).")
@click.option("--retry-delay", type=click.FloatRange(0.0), default=10.0, show_default=True,
              help="Seconds before starting again a managed run whose restart died before a checkpoint; "
                   "doubled after each such try.")
@click.option("--max-tries", type=click.IntRange(1), default=5, show_default=True,
              help="Failed restarts in a row after which the agent gives up on a run (status gave_up).")
def agent(interval: float, max_concurrent: int | None, for_seconds: float | None, retry_delay: float,
          max_tries: int) -> None:
    """Apply yield policies, restart runs that died, and start queued jobs; runs until stopped.

    Start it at login (docs/agent.md has a systemd user unit). Every decision it takes is a
    ledger event with its reason and the values it measured. A managed run that keeps dying is
    started again after 10, 20, 40... seconds, and given up after --max-tries failed tries
    (`lodger status` shows it; `lodger resume RUN` tries again). An error in one look at the
    machine is written to $LODGER_HOME/agent.log with its traceback, and the agent goes on.

    Example: lodger agent --retry-delay 30 --max-tries 3
    """
    import signal

    from ..owner.agent import Agent, AgentLock, agent_log_path
    from ..lifecycle.jobfile import user_defaults
    from ..ledger import Ledger
    from ..owner.restarts import Backoff

    user_defaults()  # a bad config.toml is refused before the agent takes its lock or records a start
    lock = AgentLock()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with Ledger() as ledger:
        ledger.event(None, "agent_started", interval=interval, retry_delay=retry_delay, max_tries=max_tries)
        click.echo(f"agent running (interval {interval:g} s); Ctrl-C stops it, runs keep going; "
                   f"errors: {agent_log_path()}")
        try:
            Agent(ledger, interval, max_concurrent, Backoff(retry_delay, max_tries)).serve_forever(for_seconds)
        except KeyboardInterrupt:
            pass
        finally:
            ledger.event(None, "agent_stopped")
    lock.fh.close()


@click.group()
def queue() -> None:
    """Jobs waiting for the agent: add, ls, rm, priority.

    Example: lodger queue add my-job.toml --priority 5
    """


@queue.command(name="add")
@click.argument("job", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--priority", type=int, default=0, show_default=True, help="Higher starts first.")
def queue_add(job: Path, priority: int) -> None:
    """Validate JOB and queue it; `lodger agent` starts it when there is room.

    The job is recorded as it is now (paths made absolute), so editing the file later does not
    change what runs.

    Example: lodger queue add my-job.toml --priority 5
    """
    from ..config.tomlfile import to_toml
    from ..lifecycle.jobfile import load_job
    from ..data.chats import read_jsonl
    from ..faults import fault_point
    from ..ledger import Ledger

    parsed = load_job(job)
    for path in (parsed.data.train, parsed.data.eval):
        if path is not None:
            read_jsonl(path)  # every line checked now, not hours later when it starts
    fault_point("queue_before_ledger")
    with Ledger() as ledger:
        queue_id = ledger.enqueue(parsed.name or job.stem, str(job.resolve()), to_toml(parsed.resolved_dict()), priority)
    click.echo(f"queued #{queue_id} ({parsed.name or job.stem}, priority {priority})")


@queue.command(name="ls")
@click.option("--json", "as_json", is_flag=True)
def queue_ls(as_json: bool) -> None:
    """List queued jobs, the next to start first.

    Example: lodger queue ls
    """
    from ..ledger import Ledger

    with Ledger() as ledger:
        entries = ledger.queue()
    if as_json:
        click.echo(json.dumps([{k: e[k] for k in ("id", "name", "priority", "added", "job_path")} for e in entries]))
        return
    for e in entries:
        click.echo(f"#{e['id']:<4} priority {e['priority']:<4} {e['name']}  ({e['job_path']})")
    if not entries:
        click.echo("the queue is empty")


@queue.command(name="rm")
@click.argument("queue_id", type=int)
def queue_rm(queue_id: int) -> None:
    """Take job QUEUE_ID off the queue.

    Example: lodger queue rm 3
    """
    from ..ledger import Ledger

    with Ledger() as ledger:
        if not ledger.cancel_queued(queue_id):
            raise LodgerError(f"no queued job #{queue_id}; `lodger queue ls` lists them")
    click.echo(f"removed #{queue_id}")


@queue.command(name="priority")
@click.argument("queue_id", type=int)
@click.argument("priority", type=int)
def queue_priority(queue_id: int, priority: int) -> None:
    """Give queued job QUEUE_ID a new PRIORITY (higher starts first): the queue's order.

    Example: lodger queue priority 3 10
    """
    from ..ledger import Ledger

    with Ledger() as ledger:
        if not ledger.set_queue_priority(queue_id, priority):
            raise LodgerError(f"no queued job #{queue_id}; `lodger queue ls` lists them")
    click.echo(f"#{queue_id} now has priority {priority}")


@click.command(name="_start-queued", hidden=True)
@click.argument("queue_id", type=int)
@click.argument("run_id", required=False)
def start_queued(queue_id: int, run_id: str | None) -> None:
    """Create and train the run for a queued job (the agent starts this in the background).

    The entry must be `starting` (the agent chose its run id) and its text must match the sha256
    its `queued` event carries; until the run exists this process holds the entry's starter lock,
    so the agent does not requeue it meanwhile. RUN_ID, the id the agent chose, guards against a
    starter that outlived a requeue starting the job a second time."""
    from ..owner.agent import StarterLock
    from .. import durable
    from ..durable import atomic_write
    from ..home import home
    from ..ledger import Ledger
    from ..lifecycle.run import Run

    lock = StarterLock(queue_id)
    with Ledger() as ledger:
        entry = ledger.queue_entry(queue_id)
        mine = entry is not None and entry["state"] == "starting" and entry["run_id"] \
            and run_id in (None, entry["run_id"])
        if not mine:
            state = f"{entry['state']}, run {entry['run_id']}" if entry else "not in the queue"
            raise LodgerError(f"queue entry #{queue_id} is not being started as run {run_id} ({state}); the agent "
                              "requeued it or another starter has it: nothing to do")
        problem = ledger.queue_text_problem(queue_id, entry["job_toml"])
        if problem:
            ledger.queue_move(queue_id, "queue_refused", ("starting",), reason=problem)
            raise LodgerError(f"queued job #{queue_id} refused: {problem}")
        snapshot = home() / "queue" / f"{queue_id}.toml"
        durable.make_dirs(snapshot.parent)
        atomic_write(snapshot, entry["job_toml"].encode())
        try:
            new = Run.create(snapshot, name=entry["name"], managed=True, run_id=entry["run_id"])
            run_id = new.run_id
        except LodgerError as exc:
            ledger.queue_move(queue_id, "queue_failed", ("starting",), error=str(exc))
            raise
        ledger.queue_move(queue_id, "queue_started", ("starting",), run_id, run_id=run_id)
    lock.release()
    from .crash import log_to_run

    log_to_run(run_id)
    new.start(resuming=False, quiet=True)


COMMANDS = [agent, queue, start_queued]
