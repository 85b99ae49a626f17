"""Federated jobs at the boundary: `lodger federate` (an owner's machine joins) and the
coordinating side of `lodger submit --federated` (cli/remote.py hands over to ``submit_federated``).

Both print what will leave, how often and within which limits, and need approval like any remote
job (--approve, or typing yes); the approval or the refusal is a chained ledger event. Printing
and refusing import neither torch nor flwr; only an approved job starts Flower processes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

NOT_APPROVED = 5  # as `lodger submit`: the owner's answer was no


def _size(n: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def print_plan(plan) -> None:
    """Plain lines: every tensor named, the bytes each round, how often, the limits, the protection."""
    s = plan.summary()
    leaves = s["leaves_each_round"]
    echo = click.echo
    if plan.side == "client":
        echo(f"joining federation at {plan.server} with dataset {plan.dataset} (the data stays on this machine)")
        echo(f"would leave this machine each round (for the server at {plan.server}):")
    else:
        echo(f"coordinating a federated run on the SuperLink at {plan.server}; each sampled client sends, each round:")
    for t in leaves["adapter_tensors"]:
        echo(f"  {t['name']}  {'x'.join(map(str, t['shape']))}  {t['bytes']} bytes")
    if leaves["tensors_unknown_because"]:
        echo(f"  adapter tensors: unknown ({leaves['tensors_unknown_because']})")
    echo(f"  adapter: {leaves['tensor_count']} tensors, {_size(leaves['adapter_bytes'])} ({leaves['adapter_bytes']} "
         f"bytes, {leaves['dtype']}) per round")
    if leaves.get("masked"):
        echo(f"  adapter {leaves['masked']}")
    echo(f"  token count: {leaves['token_count']}")
    echo(f"  metrics: {', '.join(leaves['metrics'])}")
    sampled = s["clients_per_round"] or "every connected client"
    echo(f"how often: {s['rounds']} round(s) of {s['local_steps']} local step(s); at least {s['min_clients']} "
         f"client(s) per round, sampled: {sampled}; a round waits at most {s['round_timeout_seconds']:g} s")
    limits = s["limits"]
    echo("declared limits (per client):")
    for key, value in limits.items():
        echo(f"  {key:<24}  {'MISSING' if value is None else f'{value:g}'}")
    p = s["privacy"]
    how = p.get("mechanism") or {}
    dp = (f"{how['clipping']} on each client; noise: {how['noise'] or 'none'}" if how.get("clipping")
          else "off (updates are sent unclipped and without noise)")
    echo(f"update protection: {dp}; secure aggregation "
         f"{how['secure_aggregation'] if p['secure_aggregation'] else 'off (the server sees each update)'}")
    if how.get("reproducible") and (how.get("noise") or p["secure_aggregation"]):
        echo(f"  reproducible: {how['reproducible']}")


def _ask(what: str) -> str | None:
    if not sys.stdin.isatty():
        return None
    answer = click.prompt(f"type yes to {what}", default="", show_default=False, err=True)
    return "typed yes" if answer.strip().lower() == "yes" else None


def approved(job: Path, side: str, server: str, approve: bool, as_json: bool, insecure: bool,
             dataset: str | None = None):
    """Check, print, ask, record; the approved plan, or exit (4 refused, 5 not approved)."""
    from ..errors import FederationRefused
    from ..federated import plan as fplan

    try:
        plan = fplan.check(job, side, server=server, insecure=insecure, dataset=dataset)
    except FederationRefused as refused:
        if refused.plan is not None and not as_json:
            print_plan(refused.plan)
        fplan.record(refused.plan, job, side, server, approved_by=None, reasons=refused.reasons)
        raise
    if as_json:
        click.echo(json.dumps(plan.summary(), indent=1))
    else:
        print_plan(plan)
    how = "--approve" if approve else _ask("join" if side == "client" else "run it")
    if how is None:
        fplan.record(plan, job, side, server, approved_by=None,
                     reasons=["not approved: pass --approve, or run it in a terminal and type yes"])
        click.echo("not approved: nothing was started, nothing was sent (pass --approve, or type yes at the prompt)",
                   err=as_json)
        sys.exit(NOT_APPROVED)
    fplan.record(plan, job, side, server, approved_by=how)
    return plan


@click.command()
@click.argument("job", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--server", help="The SuperLink's address, HOST:PORT (e.g. lab.example.org:9092).")
@click.option("--approve", is_flag=True, help="Join without asking (the plan is still printed and recorded).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--insecure", is_flag=True, help="Plain-text transport: only to a SuperLink on 127.0.0.1.")
@click.option("--root-certificates", type=click.Path(dir_okay=False, path_type=Path),
              help="The CA certificate that signed the SuperLink's TLS certificate.")
@click.option("--auth-key", type=click.Path(dir_okay=False, path_type=Path),
              help="This SuperNode's private key (node authentication; its public key is registered there).")
@click.option("--dataset", help="This owner's registered dataset to train on (default: the job's [data] train).")
@click.option("--client-id", help="This machine's name in the federation (letters, digits, `_`, `.`, `-`); "
                                  "default: HOSTNAME.DATASET. The server aggregates in client-id order.")
@click.option("--detach", is_flag=True, help="Return once the SuperNode runs (it keeps running in the background).")
@click.option("--hold", "hold_", is_flag=True, help="Decline this job's rounds from now on (the owner wants the "
                                                    "machine); starts nothing.")
@click.option("--continue", "continue_", is_flag=True, help="Take this job's rounds again after --hold.")
def federate(job: Path, server: str | None, approve: bool, as_json: bool, insecure: bool,
             root_certificates: Path | None, auth_key: Path | None, dataset: str | None, client_id: str | None,
             detach: bool, hold_: bool, continue_: bool) -> None:
    """Join a federated job with this machine's dataset: print what will leave, ask, start a SuperNode.

    JOB is the federated job file (the same on every machine); --dataset names this owner's
    registered dataset (default: the job's `[data] train`), which must allow federated use
    (`lodger data grant NAME --federate`): the data stays here;
    each round the adapter's tensors (all listed, with their bytes), a token count and a few
    metrics leave for the server. The declared limits (rounds, wall hours, compute per client) and
    the update protection are printed; then --approve, or typing yes, starts a Flower SuperNode
    for this owner. Before each round the client asks this machine's state: a hold (--hold), the
    job's [policy] or a limit near makes it decline that round, with the reason, on the record.

    \b
    Exit codes: 0 joined, 4 refused by a check (nothing sent), 5 not approved.
    Example: lodger federate job.toml --dataset notes --server lab.example.org:8000 --root-certificates ca.pem
             lodger federate job.toml --dataset notes --server 127.0.0.1:8000 --insecure --approve --detach
             lodger federate job.toml --dataset notes --hold
    """
    if hold_ or continue_:
        return _hold(job, hold_, dataset)
    if not server:
        raise click.UsageError("--server HOST:PORT is needed to join (or pass --hold / --continue)")
    client_id = _client_id(client_id, job, dataset)
    plan = approved(job, "client", server, approve, as_json, insecure, dataset)
    started = _start_supernode(plan, client_id, insecure, root_certificates, auth_key)
    click.echo(f"SuperNode for {plan.participation()} runs (pid {started.process.pid}); its log: {started.log}",
               err=as_json)
    if detach:
        return
    try:
        started.process.wait()
    except KeyboardInterrupt:
        started.stop()


def _hold(job: Path, hold: bool, dataset: str | None) -> None:
    from ..federated import owner
    from ..home import home

    loaded = owner.load_client_job(job, dataset)
    dataset = owner.job_dataset(loaded) or "unregistered"
    if hold:
        owner.hold(home(), loaded, dataset, "the owner holds this machine (lodger federate --hold)")
        click.echo(f"holding {owner.participation_id(loaded, dataset)}: its rounds are declined until --continue")
    else:
        owner.release_hold(home(), loaded, dataset)
        click.echo(f"continuing {owner.participation_id(loaded, dataset)}: rounds are taken again")


def _client_id(given: str | None, job: Path, dataset: str | None) -> str:
    """The given id, checked; or HOSTNAME.DATASET made into a valid id (before anything is asked)."""
    import re
    import socket

    from ..data.registry import NAME_PATTERN  # the same rule as messages.CLIENT_ID (which imports flwr)

    if given is not None:
        if not NAME_PATTERN.match(given):
            raise click.BadParameter(f"{given!r}: use letters, digits, `_`, `.`, `-` (at most 64)",
                                     param_hint="--client-id")
        return given
    from ..config import read_toml

    train = dataset or str((read_toml(job, "job file").get("data") or {}).get("train", "data"))
    name = f"{socket.gethostname()}.{train.removeprefix('dataset:').rsplit('/', 1)[-1]}"
    return re.sub(r"[^A-Za-z0-9_.-]", "-", name).lstrip("_.-")[:64] or "client"


def _start_supernode(plan, client_id: str, insecure: bool, root_certificates: Path | None,
                     auth_key: Path | None):
    from ..federated import owner
    from ..federated.processes import start_supernode
    from ..home import home

    from ..durable import make_dirs

    folder = make_dirs(owner.participation_dir(home(), plan.job, plan.dataset))
    node_config = {"lodger-home": str(home()), "dataset": plan.dataset, "job": str(plan.job_path),
                   "client-id": client_id}
    extra = [*(["--root-certificates", str(root_certificates)] if root_certificates else []),
             *(["--auth-supernode-private-key", str(auth_key)] if auth_key else [])]
    return start_supernode(folder, plan.server, node_config, insecure=insecure, extra_args=extra)


def submit_federated(job: Path, server: str, approve: bool, as_json: bool, insecure: bool) -> None:
    """`lodger submit JOB --federated --server ADDRESS`: the coordinating side (see cli/remote.py)."""
    from ..federated.processes import run_app
    from ..home import home
    from ..ledger import Ledger

    plan = approved(job, "server", server, approve, as_json, insecure)
    run_config = {"job": str(plan.job_path), "job-id": f"{plan.job.name or 'federated'}-{plan.job_hash()[:12]}",
                  "lodger-home": str(home())}
    from ..errors import LodgerError

    try:
        flower_run = run_app(home() / "federated" / "server", server, run_config, insecure=insecure)
    except LodgerError as exc:  # approved, but it never got there: that is on the record too
        with Ledger() as ledger:
            ledger.event(None, "federated_run_failed", server=server, job_hash=plan.job_hash(), error=str(exc))
        raise
    with Ledger() as ledger:
        ledger.event(None, "federated_run_started", server=server, flower_run_id=flower_run,
                     job_hash=plan.job_hash(), run_config=run_config)
    click.echo(f"flower run {flower_run}")


COMMANDS = [federate]
