"""Commands at the boundary to remote compute: submit (the gate) and the target group.

None of them imports torch or ray at import time: `submit` builds its estimate lazily, and only
an approved submission reaches ``lodger.remote``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

GiB = 2**30
NOT_APPROVED = 5  # exit code of `submit` when the plan was not approved (documented in docs/boundary.md)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _duration(seconds: float) -> str:
    from .estimate import duration  # one way of writing durations across commands

    return duration(seconds)


def _print_plan(plan) -> None:
    """Plain lines, never cut to the terminal's width: every path and hash is shown whole."""
    from ..remote.gate import LIMITS, caps

    target = plan.target
    echo = click.echo
    echo(f"would leave this machine for target {plan.target_name} ({target.kind} at {target.address}):")
    width = max(len(f.role) for f in plan.files) if plan.files else 0
    for f in plan.files:
        echo(f"  {f.role:<{width}}  {_size(f.size):>10} ({f.size} bytes)  sha256 {f.sha256}  {f.path}")
    echo(f"  {'total':<{width}}  {_size(plan.bytes):>10} ({plan.bytes} bytes) in {len(plan.files)} file(s)")
    echo("limits declared in [remote], against the target's caps:")
    cap = caps(target)
    for key in LIMITS:
        value = getattr(plan.job.remote, key)
        echo(f"  {key:<10}  {'MISSING' if value is None else f'{value:g}':>8}  cap "
             f"{'none' if cap[key] is None else f'{cap[key]:g}'}")
    est = plan.estimate
    if est:
        room = (f" of {est['available_bytes_per_process'] / GiB:.2f} GiB" if est["available_bytes_per_process"]
                else " (the target does not say its memory)")
        if est["expected_hours"] is None:
            time_text = f"time unknown for {est['total_steps']} steps: {est.get('time_unknown_because') or 'no speed'}"
        else:
            time_text = (f"about {_duration(est['expected_hours'] * 3600)} for {est['total_steps']} steps "
                         f"(speed: {est['rate_from']})")
        echo(f"estimate on {est['device']}: {est['peak_bytes_per_process'] / GiB:.2f} GiB peak per process{room}; "
             f"{time_text}")
    gpu_hours = plan.job.remote.gpu_hours
    if gpu_hours is not None:  # the most it may cost is known only once the job declares its GPU hours
        budget = "" if target.budget is None else f"; budget {target.budget:g}"
        rate = target.cost_per_gpu_hour
        echo(f"cost: at most {plan.cost:g} ({gpu_hours:g} GPU hour{'' if gpu_hours == 1 else 's'} x {rate:g} per "
             f"GPU hour){budget}" if rate else f"cost: nothing (target {plan.target_name} declares no cost per GPU "
             f"hour){budget}")


@click.command()
@click.argument("job", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--target", "target_name", help="A target from `lodger target ls`.")
@click.option("--approve", is_flag=True, help="Submit without asking (the plan is still printed and recorded).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON instead of tables.")
@click.option("--federated", is_flag=True, help="Run the [federated] job as a Flower app on the SuperLink at --server.")
@click.option("--server", help="With --federated: the SuperLink's address, HOST:PORT.")
@click.option("--insecure", is_flag=True, help="With --federated: plain-text transport (127.0.0.1 only).")
def submit(job: Path, target_name: str | None, approve: bool, as_json: bool, federated: bool, server: str | None,
           insecure: bool) -> None:
    """Check JOB against a remote target and, once approved, submit it there.

    Nothing leaves before every check passes: each data file is a registered dataset that may
    leave this machine and is allowed on the target; the job's [remote] section declares
    wall_hours, gpu_hours, cost and nodes within the target's caps; the memory and time estimate
    fits the target. The plan (every file that would leave, with size and sha256, the limits and
    the cost) is printed; then --approve, or typing `yes`, submits. A refusal lists every failed
    check and exits 4. Without an approval nothing is submitted and it exits 5 (not an error:
    the answer was no). Approvals, refusals and unapproved plans are ledger events.

    With --federated the job runs as a Flower app on the SuperLink at --server instead: what each
    client sends each round, how often and the declared limits are printed (docs/federated.md).

    \b
    Exit codes: 0 submitted, 4 refused by a check, 5 not approved, 1 the cluster failed.
    Example: lodger submit my-job.toml --target lab-ray
             lodger submit my-job.toml --target lab-ray --approve
             lodger submit fed-job.toml --federated --server 127.0.0.1:9093 --insecure
    """
    if federated or server:
        if not (federated and server) or target_name:
            raise click.UsageError("a federated job needs --federated and --server HOST:PORT (and no --target)")
        from .federate import submit_federated

        return submit_federated(job, server, approve, as_json, insecure)
    if not target_name:
        raise click.UsageError("--target T is needed (a target from `lodger target ls`), or --federated --server S")
    from ..remote import gate
    from ..errors import GateRefused

    try:
        plan = gate.check(job, target_name)
    except GateRefused as refused:
        if refused.plan is not None and not as_json:
            _print_plan(refused.plan)
        gate.record_refusal(job, target_name, refused)
        raise
    if as_json:
        click.echo(json.dumps(plan.summary(), indent=1))
    else:
        _print_plan(plan)
    how = "--approve" if approve else _ask()
    if how is None:  # the owner's answer, not an error: its own exit code, and on the record
        declined = GateRefused(["not approved: pass --approve, or run it in a terminal and type yes"],
                               plan=plan, job_hash=plan.job_hash())
        gate.record_refusal(job, target_name, declined)
        click.echo("not approved: nothing was submitted (pass --approve, or type yes at the prompt)", err=as_json)
        sys.exit(NOT_APPROVED)
    gate.record_approval(plan, how)
    from ..errors import LodgerError
    from ..ledger import Ledger
    from ..remote import submit as remote_submit

    try:
        run_id = remote_submit(plan)
    except LodgerError as exc:  # approved, but it never got there: that is on the record too
        with Ledger() as ledger:
            ledger.event(None, "submit_failed", target=target_name, job_hash=plan.job_hash(), error=str(exc))
        raise
    click.echo(f"run {run_id}")


def _ask() -> str | None:
    """"typed yes" when the user at a terminal types yes; None otherwise (no terminal: not approved)."""
    if not sys.stdin.isatty():
        return None
    answer = click.prompt("type yes to submit", default="", show_default=False, err=True)
    return "typed yes" if answer.strip().lower() == "yes" else None


@click.group()
def target() -> None:
    """Named remote targets and their caps (kept in $LODGER_HOME/targets.toml).

    \b
    Example: lodger target add lab-ray --address http://10.0.0.5:8265 --storage /mnt/shared/lodger
    """


@target.command(name="add")
@click.argument("name")
@click.option("--address", required=True, help="Ray dashboard address, e.g. http://127.0.0.1:8265.")
@click.option("--storage", required=True, help="A folder both this machine and the cluster see, or "
                                               "s3://bucket/prefix (keys from the AWS environment).")
@click.option("--python", help="The interpreter with lodger on the cluster (default: this machine's).")
@click.option("--gpu-hours", type=float, help="Cap on the GPU hours one job may declare.")
@click.option("--wall-hours", type=float, help="Cap on the wall-clock hours one job may declare.")
@click.option("--cost-per-gpu-hour", type=float, help="What one GPU hour costs there (default 0).")
@click.option("--budget", type=float, help="Cap on what one job may cost.")
@click.option("--nodes", type=int, help="Cap on the machines one job may use (default 1).")
@click.option("--gpus-per-node", type=int, help="GPUs each machine has (default 0: CPU only).")
@click.option("--memory-gb-per-node", type=float, help="Memory each machine offers (GPU memory, else RAM), GiB.")
@click.option("--tflops", type=float, help="Sustained matmul TFLOP/s per training process there (one GPU, "
                                           "or a node's CPUs): the time estimate's speed. Without it the time "
                                           "a job takes there is reported as unknown.")
@click.option("--replace", is_flag=True, help="Replace a target of the same name.")
def target_add(name: str, replace: bool, **settings) -> None:
    """Add (or with --replace, change) the remote target NAME and its caps.

    --tflops is the target's speed: without it `submit` cannot say how long a job takes there.

    \b
    Example: lodger target add lab-ray --address http://10.0.0.5:8265 --storage /mnt/shared/lodger \\
               --gpus-per-node 8 --memory-gb-per-node 640 --gpu-hours 16 --wall-hours 4 \\
               --cost-per-gpu-hour 2.5 --budget 50 --nodes 2 --tflops 300
    """
    from ..remote.targets import add_target

    added = add_target(name, settings, replace=replace)
    click.echo(f"target {name}: {added.kind} at {added.address}")


@target.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def target_ls(as_json: bool) -> None:
    """List the targets and their caps.

    Example: lodger target ls
    """
    from ..remote.targets import load_targets

    targets = load_targets()
    if as_json:
        click.echo(json.dumps({n: t.model_dump(mode="json") for n, t in sorted(targets.items())}, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None)
    for column in ("target", "address", "nodes", "gpus/node", "GiB/node", "wall h", "GPU h", "per GPU h", "budget"):
        table.add_column(column)
    show = lambda v: "-" if v is None else f"{v:g}"  # noqa: E731
    for name, t in sorted(targets.items()):
        table.add_row(name, t.address, str(t.nodes), str(t.gpus_per_node), show(t.memory_gb_per_node),
                      show(t.wall_hours), show(t.gpu_hours), show(t.cost_per_gpu_hour), show(t.budget))
    Console().print(table, markup=False)


@target.command(name="rm")
@click.argument("name")
def target_rm(name: str) -> None:
    """Remove the target NAME (recorded in the ledger).

    Example: lodger target rm lab-ray
    """
    from ..remote.targets import remove_target

    removed = remove_target(name)
    click.echo(f"removed target {name} ({removed.address})")


COMMANDS = [submit, target]
