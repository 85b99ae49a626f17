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
def agent(interval: float, max_concurrent: int | None, for_seconds: float | None) -> None:
    """Apply yield policies, restart runs that died, and start queued jobs; runs until stopped.

    Start it at login (docs/agent.md has a systemd user unit). Every decision it takes is a
    ledger event with its reason and the values it measured.

    Example: lodger agent
    """
    import signal

    from ..agent import Agent, AgentLock
    from ..ledger import Ledger

    lock = AgentLock()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with Ledger() as ledger:
        ledger.event(None, "agent_started", interval=interval)
        click.echo(f"agent running (interval {interval:g} s); Ctrl-C stops it, runs keep going")
        try:
            Agent(ledger, interval, max_concurrent).serve_forever(for_seconds)
        except KeyboardInterrupt:
            pass
        finally:
            ledger.event(None, "agent_stopped")
    lock.fh.close()


@click.group()
def queue() -> None:
    """Jobs waiting for the agent: add, ls, rm.

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
    from ..config import load_job, to_toml
    from ..data import read_jsonl
    from ..ledger import Ledger

    parsed = load_job(job)
    for path in (parsed.data.train, parsed.data.eval):
        if path is not None:
            read_jsonl(path)  # every line checked now, not hours later when it starts
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


@click.command(name="_start-queued", hidden=True)
@click.argument("queue_id", type=int)
def start_queued(queue_id: int) -> None:
    """Create and train the run for a queued job (the agent starts this in the background)."""
    from ..durable import atomic_write
    from ..home import home
    from ..ledger import Ledger
    from ..session import create_run, execute

    with Ledger() as ledger:
        entry = ledger.db.execute("SELECT * FROM queue WHERE id=?", (queue_id,)).fetchone()
        snapshot = home() / "queue" / f"{queue_id}.toml"
        snapshot.parent.mkdir(exist_ok=True)
        atomic_write(snapshot, entry["job_toml"].encode())
        try:
            run_id, prepared = create_run(snapshot, name=entry["name"], managed=True)
        except LodgerError as exc:
            with ledger.transaction():
                ledger.db.execute("UPDATE queue SET state='failed' WHERE id=?", (queue_id,))
            ledger.event(None, "queue_failed", queue_id=queue_id, error=str(exc))
            raise
        with ledger.transaction():
            ledger.db.execute("UPDATE queue SET run_id=? WHERE id=?", (run_id, queue_id))
    execute(run_id, prepared, resuming=False, quiet=True)


COMMANDS = [agent, queue, start_queued]
