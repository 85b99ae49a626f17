"""The dataset registry: what each data file is, whose it is, and what it may be used for.

A registered dataset is a file identified by its sha256, with its license, its owner and four
permissions: may it train models, may it leave this machine, to which named remote targets, and
may it take part in federated training (``may_federate``: the data stays here, but the adapter
updates trained on it, their token counts and metrics leave for the federation's server).
The registry lives in the ledger (table ``datasets``); every change is a ledger event and the row is
written from that event (ledger/records.py), so the chain tells who allowed what, when. Reading
checks the rows against the chain: a row edited outside lodger is refused, naming the dataset.

Jobs use it through ``resolve``: `[data] train = "dataset:NAME"` names a dataset, and a plain
path counts as the dataset registered at that path or with that content. A file whose content no
longer matches its registration is refused with both hashes. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from .. import durable
from ..errors import DatasetError
from ..home import ledger_path

PREFIX = "dataset:"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class FileIdentity:
    """What a file is now: its content hash, size in bytes and line count."""

    path: Path
    sha256: str
    size: int
    lines: int


@dataclass(frozen=True)
class Dataset:
    """One registered dataset (a row of the ``datasets`` table)."""

    name: str
    path: str
    sha256: str
    size: int
    lines: int
    license: str
    owner: str
    may_train: bool
    may_leave: bool
    targets: list[str] = field(default_factory=list)
    may_federate: bool = False   # the data stays; updates derived from it may leave (federated rounds)
    added: float = 0.0
    updated: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def permissions(self) -> dict:
        return {"may_train": self.may_train, "may_leave": self.may_leave, "targets": list(self.targets),
                "may_federate": self.may_federate}


@dataclass(frozen=True)
class DataUse:
    """How a job uses one data file: its role, what the file is now, and its registration (if any)."""

    role: str                    # "train" or "eval"
    reference: str = field(compare=False)  # what the job file said (a relative path is still the same use)
    file: FileIdentity
    dataset: Dataset | None      # None: an unregistered file

    def provenance(self) -> dict:
        if self.dataset is None:
            return {"registered": False, "dataset": None}
        d = self.dataset
        return {"registered": True, "dataset": {"name": d.name, "license": d.license, "owner": d.owner}}


def identify(path: Path) -> FileIdentity:
    """Hash a file and count its lines in one pass (a last line without a newline still counts)."""
    path = Path(path).expanduser().resolve()
    kind = durable.file_kind(path)
    if kind:  # a FIFO would block the read forever, a device never end
        raise DatasetError(f"{path} is {kind}, not a regular file; register a data file (JSONL) on disk")
    digest, size, lines, last = hashlib.sha256(), 0, 0, b"\n"
    try:
        with open(path, "rb") as fh:
            while block := fh.read(1 << 22):
                digest.update(block)
                size += len(block)
                lines += block.count(b"\n")
                last = block[-1:]
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read the file: {exc.strerror or exc}") from None
    if last != b"\n":
        lines += 1
    return FileIdentity(path, digest.hexdigest(), size, lines)


def _row(row) -> Dataset:
    data = dict(row)
    for flag in ("may_train", "may_leave", "may_federate"):
        data[flag] = bool(data.get(flag))
    data["targets"] = json.loads(data["targets"])
    return Dataset(**data)


@contextmanager
def _ledger(ledger=None) -> Iterator:
    from ..ledger import Ledger

    if ledger is not None:
        yield ledger
        return
    with Ledger() as opened:
        yield opened


def list_datasets(ledger=None) -> list[Dataset]:
    """Every registered dataset, by name, as the hash chain confirms it. Reading never creates the ledger.

    A row that disagrees with the chain's dataset events (a permission flipped in the table, say)
    is refused: nothing downstream (the gate, a run) may trust it."""
    if ledger is None and not ledger_path().exists():
        return []
    with _ledger(ledger) as lg:
        problems = lg.dataset_problems()
        if problems:
            listed = "\n".join(f"  - {p.where()}: {p.problem}" for p in problems)
            raise DatasetError(f"the dataset registry disagrees with the ledger's hash chain, so its permissions "
                               f"cannot be trusted:\n{listed}\nsomething edited ledger.db outside lodger; "
                               "`lodger audit` shows every such row (restore the ledger from a backup, or record the "
                               "intended permissions again with `lodger data grant` / `revoke`)")
        return [_row(r) for r in lg.datasets()]


def get(name: str, ledger=None) -> Dataset:
    """The dataset called ``name``, or a DatasetError naming the known ones."""
    for dataset in list_datasets(ledger):
        if dataset.name == name:
            return dataset
    known = ", ".join(d.name for d in list_datasets(ledger)) or "none yet"
    raise DatasetError(f"no registered dataset named {name!r} (registered: {known}); "
                       f"register it with `lodger data add FILE --name {name} --license L --owner O`")


def add(path: Path, *, name: str, license: str, owner: str, may_train: bool = True, may_leave: bool = False,
        targets: tuple[str, ...] | list[str] = (), update: bool = False,
        may_federate: bool = False) -> tuple[Dataset, str]:
    """Register ``path`` as dataset ``name``; return (the dataset, "added" / "updated" / "unchanged").

    An existing name with different content, path, license or owner needs ``update=True``; the
    same content under another name is refused (a file is one dataset, so a job's plain path
    resolves to exactly one registration)."""
    if not NAME_PATTERN.match(name):
        raise DatasetError(f"--name {name!r}: use letters, digits, `_`, `.`, `-` (at most 64, starting with a "
                           "letter or digit)")
    for flag, value in (("--license", license), ("--owner", owner)):
        if not value.strip():
            raise DatasetError(f"{flag} is empty; say what it is (e.g. --license CC-BY-4.0 --owner alice)")
    for target in targets:
        if not NAME_PATTERN.match(target):
            raise DatasetError(f"--target {target!r} is not a target name (letters, digits, `_`, `.`, `-`)")
    ident = identify(path)
    from ..ledger import Ledger

    durable.fault_point("dataset_before_ledger")
    with Ledger() as ledger, ledger.transaction():
        registry = {d.name: d for d in list_datasets(ledger)}
        existing = registry.get(name)
        twin = next((d for d in registry.values() if d.sha256 == ident.sha256 and d.name != name), None)
        if twin:
            raise DatasetError(f"{ident.path}: this content (sha256 {ident.sha256}) is already registered as "
                               f"dataset {twin.name!r}; use that name (`lodger data show {twin.name}`)")
        if existing is None:
            ledger.event(None, "dataset_added", name=name, path=str(ident.path), sha256=ident.sha256,
                         size=ident.size, lines=ident.lines, license=license, owner=owner, may_train=may_train,
                         may_leave=may_leave, targets=sorted(set(targets)), may_federate=may_federate)
            return _named(ledger, name), "added"
        old = existing
        changes = {k: (getattr(old, k), v) for k, v in
                   (("path", str(ident.path)), ("sha256", ident.sha256), ("license", license), ("owner", owner))
                   if getattr(old, k) != v}
        if not changes:
            return old, "unchanged"
        if not update:
            listed = "; ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
            raise DatasetError(f"dataset {name!r} is already registered, differently ({listed}); if that is "
                               "intended, record it with --update (the change is a ledger event)")
        # Permissions stay as granted: an update changes what the file is, not what it may do.
        ledger.event(None, "dataset_updated", name=name, path=str(ident.path), sha256=ident.sha256,
                     size=ident.size, lines=ident.lines, license=license, owner=owner, **old.permissions(),
                     previous={k: a for k, (a, _) in changes.items()})
        return _named(ledger, name), "updated"


def _named(ledger, name: str) -> Dataset:
    return next(_row(r) for r in ledger.datasets() if r["name"] == name)


def change_permissions(name: str, *, allow: bool, train: bool = False, leave: bool = False,
                       targets: tuple[str, ...] | list[str] = (), federate: bool = False) -> tuple[Dataset, bool]:
    """Grant (``allow``) or revoke permissions; return (the dataset, whether anything changed).

    A change is one `dataset_granted` / `dataset_revoked` event with what was asked and the result."""
    verb = "grant" if allow else "revoke"
    if not (train or leave or targets or federate):
        raise DatasetError(f"nothing to {verb}: give --train, --leave, --federate and/or --target NAME")
    for target in targets:
        if not NAME_PATTERN.match(target):
            raise DatasetError(f"--target {target!r} is not a target name (letters, digits, `_`, `.`, `-`)")
    from ..ledger import Ledger

    with Ledger() as ledger, ledger.transaction():
        old = get(name, ledger)  # raises, naming the registered ones
        may_train = allow if train else old.may_train
        may_leave = allow if leave else old.may_leave
        may_federate = allow if federate else old.may_federate
        listed = set(old.targets) | set(targets) if allow else set(old.targets) - set(targets)
        new = sorted(listed)
        if (may_train, may_leave, new, may_federate) == (old.may_train, old.may_leave, sorted(old.targets),
                                                         old.may_federate):
            return old, False
        asked = {"train": train, "leave": leave, "targets": sorted(set(targets))}
        if federate:  # only when asked, so that older events keep their exact shape
            asked["federate"] = True
        after = {"may_train": may_train, "may_leave": may_leave, "targets": new, "may_federate": may_federate}
        ledger.event(None, "dataset_granted" if allow else "dataset_revoked", name=name, asked=asked,
                     before=old.permissions(), after=after, sha256=old.sha256)
        return _named(ledger, name), True


def grant(name: str, **what) -> tuple[Dataset, bool]:
    return change_permissions(name, allow=True, **what)


def revoke(name: str, **what) -> tuple[Dataset, bool]:
    return change_permissions(name, allow=False, **what)


# -- what a job's data file is ----------------------------------------------------------------
def resolve(role: str, reference: str, base_dir: Path, *, unregistered: str = "warn",
            registry: list[Dataset] | None = None) -> tuple[DataUse | None, list[str]]:
    """Resolve a job's `[data] <role>` value to a DataUse, or the problems (each with its fix).

    `dataset:NAME` must be registered; a path counts as the dataset registered at that path or
    with that content. Refused: content that changed since registration (both hashes shown), a
    dataset that may not train, and an unregistered file when ``unregistered == "strict"``."""
    key = f"[data] {role} = {reference!r}"
    registry = list_datasets() if registry is None else registry
    if reference.startswith(PREFIX):
        name = reference[len(PREFIX):]
        dataset = next((d for d in registry if d.name == name), None)
        if dataset is None:
            known = ", ".join(d.name for d in registry) or "none yet"
            return None, [f"{key}: no registered dataset named {name!r} (registered: {known}); fix: correct the "
                          f"name, or `lodger data add FILE --name {name} --license L --owner O`"]
        path = Path(dataset.path)
        if not path.is_file():
            return None, [f"{key}: dataset {name!r} is registered at {path}, which is not there any more; fix: put "
                          f"it back, or register its new place with `lodger data add NEWPATH --name {name} "
                          f"--license {dataset.license!r} --owner {dataset.owner!r} --update`"]
        ident = identify(path)
    else:
        ident = identify(base_dir / reference)
        dataset = next((d for d in registry if d.path == str(ident.path)), None) \
            or next((d for d in registry if d.sha256 == ident.sha256), None)
    if dataset is None:
        if unregistered == "strict":
            return None, [f"{key}: {ident.path} is not a registered dataset, and $LODGER_HOME/config.toml says "
                          f"[datasets] unregistered = \"strict\"; fix: `lodger data add {ident.path} --name NAME "
                          "--license L --owner O`"]
        return DataUse(role, reference, ident, None), []
    problems = []
    if dataset.sha256 != ident.sha256:
        problems.append(f"{key}: {ident.path} changed since it was registered as dataset {dataset.name!r} "
                        f"(registered sha256 {dataset.sha256}, now {ident.sha256}); fix: check the file, then "
                        f"record the new content with `lodger data add {ident.path} --name {dataset.name} "
                        f"--license {dataset.license!r} --owner {dataset.owner!r} --update`")
    if not dataset.may_train:
        problems.append(f"{key}: dataset {dataset.name!r} (license {dataset.license}, owner {dataset.owner}) may "
                        f"not train models; fix: use other data, or, if its owner allows it, "
                        f"`lodger data grant {dataset.name} --train`")
    return (None if problems else DataUse(role, reference, ident, dataset)), problems
