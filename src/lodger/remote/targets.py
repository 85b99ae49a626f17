"""Named remote targets, kept in $LODGER_HOME/targets.toml: where a job may go and the owner's caps.

A target is only a description; nothing here talks to it. `lodger submit` (the gate) checks a
job against it, and `remote/` runs an approved job there. No torch, no ray.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, ValidationError, field_validator

from ..config import Float, Int, Section, describe, read_toml
from ..config.tomlfile import toml_value
from ..errors import JobFileError, LodgerError
from ..home import home


class Target(Section):
    """One remote target and the caps its owner set on it."""

    kind: str = "ray"
    """The engine there, one of the backend kinds in remote/backend.py: `ray`, a Ray cluster
    reached through its job submission API."""
    address: str
    """The Ray dashboard address, e.g. http://127.0.0.1:8265."""
    storage: str
    """Where everything that crosses lives (staged job, data and model, checkpoints, the event
    log, logs, pause requests): a folder both this machine and the cluster see (`/mnt/shared/x`
    or `file:///mnt/shared/x`), or S3-compatible object storage (`s3://bucket/prefix`; endpoint
    and credentials from the usual AWS environment variables or AWS_PROFILE, never stored)."""
    python: str | None = None
    """The interpreter with lodger installed on the cluster (a Ray job runs with the head's PATH);
    default: this machine's, right for a cluster on this machine."""
    gpu_hours: Float | None = Field(None, ge=0)
    """Cap on the GPU hours any one job may declare."""
    wall_hours: Float | None = Field(None, gt=0)
    """Cap on the wall-clock hours any one job may declare."""
    cost_per_gpu_hour: Float = Field(0.0, ge=0)
    """What one GPU hour costs there, in the owner's currency."""
    budget: Float | None = Field(None, ge=0)
    """Cap on what any one job may cost."""
    nodes: Int = Field(1, ge=1)
    """Cap on machines one job may use."""
    gpus_per_node: Int = Field(0, ge=0)
    """GPUs each machine has (0: CPU only)."""
    memory_gb_per_node: Float | None = Field(None, gt=0)
    """Memory each machine offers a job (GPU memory where it has GPUs, else RAM), for the estimate.
    The gate divides it among the GPUs (each training process has one) or, on CPUs, among the
    processes a node runs."""
    tflops: Float | None = Field(None, gt=0)
    """Sustained matmul TFLOP/s one training process reaches there (one GPU, or a node's CPUs),
    for the time estimate. Left out: `submit` says the time there is unknown (this machine's rate
    says nothing about another machine's)."""

    @field_validator("kind")
    @classmethod
    def _a_known_backend(cls, value: str) -> str:
        from .backend import check_kind  # the registry of kinds: no engine imported

        return check_kind(value)

    @field_validator("storage")
    @classmethod
    def _a_folder_or_a_bucket(cls, value: str) -> str:
        from urllib.parse import urlparse

        parsed = urlparse(value)
        if parsed.scheme not in ("", "file", "s3", "s3a"):
            raise ValueError("not a folder or an s3:// URI; use /path, file:///path or s3://bucket/prefix")
        if "@" in parsed.netloc:  # s3://KEY:SECRET@bucket would put the secret in targets.toml
            raise ValueError("credentials do not belong in the storage URI (it is saved in targets.toml); set "
                             "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE in the environment instead")
        if parsed.scheme.startswith("s3") and not parsed.netloc:
            raise ValueError("no bucket; write s3://bucket/prefix")
        return value

    @field_validator("address")
    @classmethod
    def _an_http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")) or len(value.split()) != 1:
            raise ValueError("not an http(s) URL; use the Ray dashboard's, e.g. http://10.0.0.5:8265")
        return value


class TargetError(LodgerError):
    """The targets file is bad, or the named target does not exist."""

    exit_code = 2


def targets_path() -> Path:
    return home() / "targets.toml"


def load_targets() -> dict[str, Target]:
    """Every target in the user's file, validated; one error lists every problem."""
    path = targets_path()
    if not path.exists():
        return {}
    try:
        raw = read_toml(path, "targets file")
    except JobFileError as exc:
        raise TargetError(str(exc)) from None
    targets, problems = {}, []
    for key in sorted(raw.keys() - {"targets"}):
        problems.append(f"{key}: unknown key; every target is a table `[targets.NAME]`; fix: move it under "
                        "one or remove it")
    tables = raw.get("targets", {})
    if not isinstance(tables, dict):
        problems.append(f"targets = {tables!r}: expected tables `[targets.NAME]`; fix: write each target as "
                        "`[targets.NAME]` with its keys below (or use `lodger target add`)")
        tables = {}
    for name, table in tables.items():
        if not isinstance(table, dict):
            problems.append(f"targets.{name} = {table!r}: expected a table; fix: write `[targets.{name}]` "
                            "with its keys below")
            continue
        if not re.match(NAME_PATTERN, name):
            problems.append(f"[targets.{name}]: not a target name; fix: rename it with letters, digits, `_`, `.`, "
                            "`-` (at most 64)")
        try:
            targets[name] = Target.model_validate(table)
        except ValidationError as exc:
            problems += [f"[targets.{name}] " + describe(e, Target).removeprefix("[") for e in exc.errors()]
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise TargetError(f"{path}: {len(problems)} problem(s) in the targets file; edit it to fix them:\n{listed}")
    return targets


def get_target(name: str, recorded: bool = False) -> Target:
    """Target ``name`` from targets.toml; with ``recorded``, only as the ledger's chain recorded it
    (caps are the owner's limits: a change that skipped `lodger target add` is refused)."""
    targets = load_targets()
    if name not in targets:
        known = ", ".join(sorted(targets)) or "none yet"
        raise TargetError(f"no target named {name!r} (known: {known}); add one with `lodger target add {name} ...`")
    if recorded:
        _check_recorded(name, targets[name])
    return targets[name]


def _check_recorded(name: str, target: Target) -> None:
    from ..ledger import Ledger
    from ..ledger.records import target_differences

    with Ledger() as ledger:
        chained = ledger.chain_targets().get(name)
    changed = target_differences(chained or {}, target.model_dump(mode="json"))
    if chained is None or changed:
        what = ("is not recorded in the ledger" if chained is None
                else f"differs from what the ledger recorded ({', '.join(changed)})")
        raise TargetError(f"{targets_path()}: target {name!r} {what}, so it was edited by hand; the gate trusts "
                          f"only caps the ledger recorded: record them with `lodger target add {name} ... --replace`")


def save_targets(targets: dict[str, Target]) -> None:
    """Rewrite the targets file atomically (it is the user's settings, not run state)."""
    from ..durable import atomic_write

    lines = ["# lodger's remote targets: edit with `lodger target add` (the ledger records each change; the",
             "# gate refuses a target edited here by hand until `lodger target add NAME ... --replace` records it)."]
    for name, target in sorted(targets.items()):
        lines += ["", f"[targets.{name}]"]
        lines += [f"{k} = {toml_value(v)}" for k, v in target.model_dump(mode="json", exclude_none=True).items()]
    atomic_write(targets_path(), ("\n".join(lines) + "\n").encode())


NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


def add_target(name: str, settings: dict, *, replace: bool = False) -> Target:
    """Validate and save a target; a `target_added` ledger event records it (and what it replaced)."""
    from ..ledger import Ledger

    if not re.match(NAME_PATTERN, name):
        raise TargetError(f"target name {name!r}: use letters, digits, `_`, `.`, `-` (at most 64)")
    try:
        target = Target.model_validate({k: v for k, v in settings.items() if v is not None})
    except ValidationError as exc:
        problems = [describe(e, Target) for e in exc.errors()]
        listed = "\n".join(f"  - {p}" for p in problems)
        raise TargetError(f"target {name!r}: {len(problems)} problem(s) (each key is the option of the same "
                          f"name, `_` written `-`):\n{listed}") from None
    targets = load_targets()
    previous = targets.get(name)
    if previous is not None and not replace:
        raise TargetError(f"a target named {name!r} exists already ({previous.address}); pass --replace to "
                          "change it, or pick another name")
    targets[name] = target
    with Ledger() as ledger:
        save_targets(targets)
        ledger.event(None, "target_added", name=name, target=target.model_dump(mode="json"),
                     replaced=previous.model_dump(mode="json") if previous else None)
    return target


def remove_target(name: str) -> Target:
    """Delete a target from the user's file; a `target_removed` ledger event records what it was."""
    from ..ledger import Ledger

    targets = load_targets()
    target = get_target(name)
    del targets[name]
    with Ledger() as ledger:
        save_targets(targets)
        ledger.event(None, "target_removed", name=name, target=target.model_dump(mode="json"))
    return target
