"""Bring a remote run's results home: checkpoints, metrics, log, adapter and events (no ray, no torch).

Everything is read from the target's storage folder, which this machine sees. Only committed
checkpoints that verify against their manifest are copied (through durable.py, like any
checkpoint); the remote ledger's new events become ``remote_event`` events on the local run, its
metric rows are stored locally, and the local run's status and step follow the remote one.
Safe to repeat and to run while the remote job writes: what is half-written is skipped now and
picked up next time.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
import tomllib
from pathlib import Path

from .. import durable
from ..checkpoint import MANIFEST, CheckpointStore
from ..errors import CheckpointError, RunNotFound
from ..home import run_dir
from . import RemoteError, remote_home, remote_info, remote_run_dir

STICKY = ("cancelled",)  # local decisions the remote side's later events do not overturn


def sync(ledger, run: dict) -> dict:
    """Copy what is new from storage into the local run and ledger; return the updated run row.

    Raises RemoteError, and copies nothing, when the job in storage is not the one submitted."""
    staged = staged_job(run)
    source, local = remote_run_dir(run), run_dir(run["id"])
    if not source.is_dir():
        return run  # the remote worker has not created its run yet
    local.mkdir(exist_ok=True)
    keep = _keep_last(staged if staged is not None else _read(source / "job.toml"))
    copied = _sync_checkpoints(source / "checkpoints", local / "checkpoints", keep)
    for name in ("metrics.jsonl", "log.txt", "provenance.json"):
        _mirror_file(source / name, local / name)
    _mirror_adapter(source / "adapter", local / "adapter")
    _ingest_ledger(ledger, run, copied)
    return ledger.run(run["id"])


def staged_job(run: dict) -> bytes | None:
    """The job.toml the run left with, read from storage and checked against the sha256 recorded
    at submission; None for a run submitted before lodger recorded it (nothing to check against)."""
    info = remote_info(run)
    wanted = info.get("job_sha256")
    if wanted is None:
        return None
    path = Path(info["dir"]) / "job.toml"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RemoteError(f"{path}: cannot read the job run {run['id']} was submitted with ({exc.strerror}); "
                          "lodger copies nothing from this storage folder until it is back") from None
    got = hashlib.sha256(data).hexdigest()
    if got != wanted:
        raise RemoteError(f"{path}: sha256 {got} is not the {wanted} recorded when run {run['id']} was submitted: "
                          "the job was changed in storage, so lodger copies nothing from it and resubmits "
                          "nothing; inspect the folder, then `lodger cancel` the run and submit the job again")
    return data


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _keep_last(staged: bytes | None) -> int:
    from ..config import CheckpointConfig

    try:
        table = tomllib.loads(staged.decode()).get("checkpoints", {})
        return CheckpointConfig.model_validate(table).keep_last
    except Exception:  # noqa: BLE001 - a job we cannot read keeps the default
        return CheckpointConfig().keep_last


def _sync_checkpoints(remote_root: Path, local_root: Path, keep_last: int) -> list[str]:
    """Copy committed remote checkpoints that verify and are not here yet; prune like the run does."""
    if not remote_root.is_dir():
        return []
    remote = CheckpointStore.__new__(CheckpointStore)  # read-only view: never create folders in storage
    remote.root, remote.keep_last, remote.world_size = remote_root, keep_last, 1
    store = CheckpointStore(local_root, keep_last)
    store.clean_stale()
    have = {step for step, _ in store.committed()}
    copied = []
    for step, path in reversed(remote.committed()[:keep_last]):
        if step in have:
            continue
        try:
            ckpt = remote.load(path)  # every file checked against the manifest
            manifest = (path / MANIFEST).read_bytes()
        except (CheckpointError, OSError):
            continue  # pruned or written right now: the next sync sees its successor
        if json.loads(manifest).get("manifest_sha256") != ckpt.manifest.get("manifest_sha256"):
            continue  # replaced between the two reads
        tmp = local_root / f".tmp-{step:08d}-sync-{secrets.token_hex(4)}"
        durable.mkdir(tmp)
        for name, data in ckpt.files.items():
            durable.write_file(tmp / name, data)
        durable.write_file(tmp / MANIFEST, manifest)  # last, as in CheckpointStore.save
        durable.fsync_dir(tmp)
        try:
            durable.rename(tmp, local_root / path.name)
        except OSError:  # another sync got there first
            durable.remove_tree(tmp)
            continue
        durable.fsync_dir(local_root)
        copied.append(path.name)
    store.prune()
    return copied


def _read_regular(path: Path) -> bytes | None:
    """A plain file's bytes from storage; None for anything else (a FIFO would block us, a symlink
    would copy whatever it points at on this machine)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return fh.read()


def _mirror_file(source: Path, target: Path) -> None:
    data = _read_regular(source)
    if data is None:
        return
    try:
        if target.read_bytes() == data:
            return
    except OSError:
        pass
    durable.atomic_write(target, data)


def _mirror_adapter(source: Path, target: Path) -> None:
    """The final weights, once the remote run wrote them (its folder appears by an atomic rename)."""
    if not source.is_dir() or source.is_symlink():
        return
    files = {}
    for path in source.iterdir():
        data = _read_regular(path) if durable.is_plain_name(path.name) else None
        if data is not None:
            files[path.name] = data
    if target.is_dir() and {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()} == files:
        return
    durable.write_folder(target, files, tmp_prefix=".adapter-tmp-", replace=True)


def _ingest_ledger(ledger, run: dict, copied: list[str]) -> None:
    """New remote events and every metric row into the local ledger, with the run's state, at once."""
    from ..ledger import Ledger

    path = remote_home(run) / "ledger.db"
    if not path.is_file() or path.is_symlink():  # e.g. a link to this machine's own ledger
        return
    with Ledger(path) as remote:
        try:
            remote_run = remote.run(run["id"])
        except RunNotFound:
            return
        events = [e for e in remote.events(run["id"]) if e["seq"] > (run.get("remote_seq") or 0)]
        metrics = {kind: remote.metrics(run["id"], kind) for kind in ("train", "eval")}
    with ledger.transaction():
        for e in events:
            ledger.event(run["id"], "remote_event", remote_kind=e["kind"], data=e["data"], remote_seq=e["seq"],
                         remote_time=e["time"])
        for records in metrics.values():
            by_segment: dict[int, list[dict]] = {}
            for r in records:
                by_segment.setdefault(r.pop("segment"), []).append(r)
            for segment, rows in by_segment.items():
                ledger.add_metrics(run["id"], segment, rows)
        if copied:
            ledger.event(run["id"], "remote_checkpoints_synced", checkpoints=copied)
        fields = {"step": remote_run["step"], "loss": remote_run["loss"], "segment": remote_run["segment"],
                  "total_steps": remote_run["total_steps"]}
        if events:
            fields["remote_seq"] = events[-1]["seq"]
            if run["status"] not in STICKY:
                fields["status"] = remote_run["status"]
        ledger.update_run(run["id"], **fields)
