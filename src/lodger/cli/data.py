"""The `data` command group: register datasets and their permissions (add, ls, show, grant, revoke).

No torch here: registering hashes a file, everything else reads or writes the ledger.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click


def _permissions(d) -> str:
    leave = f"may leave to: {', '.join(d.targets) or 'no target'}" if d.may_leave else "may not leave this machine"
    federate = ("may federate (the data stays; updates trained on it leave)" if d.may_federate
                else "may not federate")
    return f"{'may train' if d.may_train else 'may NOT train'}; {leave}; {federate}"


@click.group()
def data() -> None:
    """Registered datasets: what each file is, whose, under which license, and what it may do.

    \b
    Example: lodger data add corpus.jsonl --name corpus --license CC-BY-4.0 --owner alice
    """


@data.command(name="add")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--name", required=True, help="The dataset's name; jobs say `train = \"dataset:NAME\"`.")
@click.option("--license", "license_", required=True, help="Its license, e.g. CC-BY-4.0 or proprietary.")
@click.option("--owner", required=True, help="Who owns it (and decides what it may do).")
@click.option("--no-train", is_flag=True, help="It may not train models (default: it may).")
@click.option("--leave", is_flag=True, help="It may leave this machine (default: it may not).")
@click.option("--target", "targets", multiple=True, help="A remote target it may go to (repeatable).")
@click.option("--federate", is_flag=True, help="It may take part in federated training: the data stays here, "
                                               "adapter updates trained on it leave (default: it may not).")
@click.option("--update", is_flag=True, help="Record new content, path, license or owner for an existing name.")
def data_add(file: Path, name: str, license_: str, owner: str, no_train: bool, leave: bool,
             targets: tuple[str, ...], update: bool, federate: bool) -> None:
    """Register FILE as a dataset: its sha256, size and line count, license, owner and permissions.

    New datasets may train, may not leave this machine and may not federate unless told otherwise
    (--no-train, --leave, --target, --federate). --federate is distinct from --leave: the file
    never leaves, but adapter updates trained on it (and their token counts and metrics) go to a
    federation's server each round. A job whose data changed after registration is refused until the new
    content is recorded with --update.

    \b
    Example: lodger data add corpus.jsonl --name corpus --license CC-BY-4.0 --owner alice \\
               --leave --target lab-ray
    """
    from ..data import registry as datasets

    dataset, what = datasets.add(file, name=name, license=license_, owner=owner, may_train=not no_train,
                                 may_leave=leave, targets=targets, update=update, may_federate=federate)
    if what == "unchanged":
        click.echo(f"dataset {name} is already registered with this content (sha256 {dataset.sha256}); "
                   "permissions are changed with `lodger data grant` / `revoke`")
        return
    click.echo(f"{what} dataset {name}: {dataset.path} ({dataset.size} bytes, {dataset.lines} lines, "
               f"sha256 {dataset.sha256}); {_permissions(dataset)}")


@data.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def data_ls(as_json: bool) -> None:
    """List registered datasets and their permissions.

    Example: lodger data ls
    """
    from ..data.registry import list_datasets

    found = list_datasets()
    if as_json:
        click.echo(json.dumps([d.to_dict() for d in found], indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None)
    for column in ("dataset", "lines", "bytes", "license", "owner", "train", "leave", "federate", "targets",
                   "sha256"):
        table.add_column(column)
    for d in found:
        table.add_row(d.name, str(d.lines), str(d.size), d.license, d.owner, "yes" if d.may_train else "no",
                      "yes" if d.may_leave else "no", "yes" if d.may_federate else "no", ", ".join(d.targets) or "-",
                      d.sha256[:12])
    Console().print(table, markup=False)


@data.command(name="show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def data_show(name: str, as_json: bool) -> None:
    """A dataset's file, identity, license, owner, permissions and history (its ledger events).

    Example: lodger data show corpus
    """
    from ..data.registry import get
    from ..ledger import Ledger

    dataset = get(name)
    with Ledger() as ledger:
        history = [e for e in ledger.events() if e["run_id"] is None and e["kind"].startswith("dataset_")
                   and e["data"].get("name") == name]
    if as_json:
        click.echo(json.dumps({**dataset.to_dict(), "events": history}, indent=1))
        return
    stamp = lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))  # noqa: E731
    click.echo(f"dataset {dataset.name}\n  file     {dataset.path}\n  sha256   {dataset.sha256}\n"
               f"  size     {dataset.size} bytes, {dataset.lines} lines\n  license  {dataset.license}\n"
               f"  owner    {dataset.owner}\n  allowed  {_permissions(dataset)}\n"
               f"  added    {stamp(dataset.added)}, last changed {stamp(dataset.updated)}")
    for event in history:
        click.echo(f"  {stamp(event['time'])}  {event['kind']}")


def _permission_options(command):
    command = click.option("--target", "targets", multiple=True, help="A remote target (repeatable).")(command)
    command = click.option("--leave", is_flag=True, help="Leaving this machine.")(command)
    command = click.option("--federate", is_flag=True, help="Federated training (the data stays; updates "
                                                            "trained on it leave).")(command)
    return click.option("--train", is_flag=True, help="Training models.")(command)


@data.command(name="grant")
@click.argument("name")
@_permission_options
def data_grant(name: str, train: bool, leave: bool, federate: bool, targets: tuple[str, ...]) -> None:
    """Allow dataset NAME to train (--train), leave this machine (--leave), go to a target (--target T),
    or take part in federated training (--federate: the data stays, adapter updates leave).

    \b
    Example: lodger data grant corpus --leave --target lab-ray
             lodger data grant clinic-notes --federate
    """
    from ..data.registry import grant

    dataset, changed = grant(name, train=train, leave=leave, targets=targets, federate=federate)
    click.echo(f"{'granted' if changed else 'no change'}: {name} {_permissions(dataset)}")


@data.command(name="revoke")
@click.argument("name")
@_permission_options
def data_revoke(name: str, train: bool, leave: bool, federate: bool, targets: tuple[str, ...]) -> None:
    """Withdraw what dataset NAME may do (same flags as grant).

    Example: lodger data revoke corpus --target lab-ray
    """
    from ..data.registry import revoke

    dataset, changed = revoke(name, train=train, leave=leave, targets=targets, federate=federate)
    click.echo(f"{'revoked' if changed else 'no change'}: {name} {_permissions(dataset)}")


COMMANDS = [data]
