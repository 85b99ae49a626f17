"""Bring a remote run's results home: checkpoints, metrics, log, adapter and events (no ray, no torch).

Everything is read through the run's storage (``storage.py``: a shared folder or a bucket).
Only committed checkpoints whose every byte verifies against their manifest are copied (a
checkpoint without a complete, verifying manifest does not exist). The remote side's news comes
from its hash-chained event log (``eventlog.py``), never from a remote database: each record must
continue the chain this machine holds (the ledger head recorded at submission, then the last
record taken, kept in the run's ``remote_seq`` and ``remote_log_hash``); its events become
``remote_event`` events on the local run, its metric rows are stored locally, and the local run's
status and step follow the remote one. Safe to repeat and to run while the remote job writes:
what is half-written is skipped now and picked up next time.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

from .. import durable
from ..checkpoint import CheckpointStore
from ..errors import CheckpointError
from ..home import run_dir
from .backend import RemoteError
from .place import remote_info, run_key, run_storage
from .eventlog import ChainError, EventLog
from .storage import MANIFEST, StorageError, StoredCheckpoint, failures, fetch, list_checkpoints, verify

STICKY = ("cancelled",)  # local decisions the remote side's later events do not overturn
GENESIS = "0" * 64


def sync(ledger, run: dict) -> dict:
    """Copy what is new from storage into the local run and ledger; return the updated run row.

    Raises RemoteError, and copies nothing, when the job in storage is not the one submitted or
    the event log does not continue the chain recorded here."""
    staged = staged_job(run)
    store = run_storage(run)
    key, local = run_key(run["id"]), run_dir(run["id"])
    try:
        records = _new_records(store, run)
        if not store.exists(key) and not records:
            return run  # the remote worker has not created its run yet
        durable.make_dirs(local)
        keep = _keep_last(staged if staged is not None else _read(store, "job.toml"))
        copied = _sync_checkpoints(store, f"{key}/checkpoints", local / "checkpoints", keep)
        for name in ("metrics.jsonl", "log.txt", "provenance.json", "control/state.json"):
            _mirror_file(store, f"{key}/{name}", local / name)
        _mirror_adapter(store, f"{key}/adapter", local / "adapter")
    except failures() as exc:
        raise RemoteError(f"{remote_info(run)['dir']}: storage cannot be read now ({exc}); nothing was "
                          "taken from it, try again once it is reachable") from None
    _ingest(ledger, run, records, copied)
    return ledger.run(run["id"])


def staged_job(run: dict) -> bytes | None:
    """The job.toml the run left with, read from storage and checked against the sha256 recorded
    at submission; None for a run submitted before lodger recorded it (nothing to check against)."""
    info = remote_info(run)
    wanted = info.get("job_sha256")
    if wanted is None:
        return None
    where = f"{info['dir']}/job.toml"
    try:
        data = run_storage(run).read_bytes("job.toml")
    except failures() as exc:
        raise RemoteError(f"{where}: cannot read the job run {run['id']} was submitted with ({exc}); "
                          "lodger copies nothing from this storage until it is back") from None
    got = hashlib.sha256(data).hexdigest()
    if got != wanted:
        raise RemoteError(f"{where}: sha256 {got} is not the {wanted} recorded when run {run['id']} was submitted: "
                          "the job was changed in storage, so lodger copies nothing from it and resubmits "
                          "nothing; inspect it, then `lodger cancel` the run and submit the job again")
    return data


def _read(store, key: str) -> bytes | None:
    try:
        return store.read_bytes(key)
    except FileNotFoundError:
        return None
    except StorageError:  # a local symlink or FIFO: never followed
        return None


def _keep_last(staged: bytes | None) -> int:
    from ..config import CheckpointConfig

    try:
        table = tomllib.loads(staged.decode()).get("checkpoints", {})
        return CheckpointConfig.model_validate(table).keep_last
    except Exception:  # noqa: BLE001 - a job we cannot read keeps the default
        return CheckpointConfig().keep_last


def _sync_checkpoints(store, prefix: str, local_root: Path, keep_last: int) -> list[str]:
    """Copy the newest committed remote checkpoints that verify and are not here yet; prune like
    the run does. A folder without a verifying manifest is not listed; one whose bytes do not
    match its manifest is not copied (``storage.fetch`` writes nothing then)."""
    found = list_checkpoints(store, prefix)[:keep_last]
    if not found:
        return []
    local = CheckpointStore(local_root, keep_last)  # it makes its folder, durably
    local.clean_stale()
    have = {step for step, _ in local.committed()}
    copied = []
    for ckpt in reversed(found):
        if ckpt.step in have:
            continue
        try:
            copied.append(fetch(store, ckpt, local_root).name)
        except (CheckpointError, StorageError, FileNotFoundError, FileExistsError):
            continue  # pruned or written right now (or altered): the next sync sees its successor
    local.prune()
    return copied


def _mirror_file(store, key: str, target: Path) -> None:
    data = _read(store, key)  # a local symlink or FIFO is refused by Storage.read_bytes
    if data is None:
        return
    try:
        if target.read_bytes() == data:
            return
    except OSError:
        pass
    durable.atomic_write(durable.make_dirs(target.parent) / target.name, data)


def _mirror_adapter(store, key: str, target: Path) -> None:
    """The final weights, once the remote run wrote them: on a shared folder its folder appears by
    an atomic rename; on object storage it is committed like a checkpoint (manifest last)."""
    entries = store.entries(key)
    if not entries:
        return
    if store.local:
        files = {n: d for n, size in entries.items() if size is not None and (d := _read(store, f"{key}/{n}"))
                 is not None}
    else:
        raw = _read(store, f"{key}/{MANIFEST}")
        if raw is None:
            return  # not committed yet
        try:
            manifest = json.loads(raw)
            files = verify(store, StoredCheckpoint(step=-1, key=key, manifest=manifest, manifest_bytes=raw))
        except (ValueError, TypeError, AttributeError, KeyError, CheckpointError):
            return
        if any(not durable.is_plain_name(n) or n == MANIFEST for n in files):
            return
    if not files:
        return
    if target.is_dir() and {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()} == files:
        return
    durable.write_folder(target, files, tmp_prefix=".adapter-tmp-", replace=True)


def _new_records(store, run: dict) -> list[dict]:
    """The event log's records after the last one taken here, verified to continue it."""
    anchor = remote_info(run).get("anchor") or GENESIS
    since, held = run.get("remote_seq") or 0, run.get("remote_log_hash") or anchor
    log = EventLog(store, "events", run_id=run["id"], anchor=anchor)
    try:
        return log.read_new(since, held)
    except ChainError as exc:
        raise RemoteError(f"run {run['id']}: {exc}") from None


def _ingest(ledger, run: dict, records: list[dict], copied: list[str]) -> None:
    """The new records' events, metric rows and run state into the local ledger, at once."""
    state = None
    with ledger.transaction():
        for record in records:
            batch = record["data"] if record["kind"] == "batch" and isinstance(record["data"], dict) else {}
            for e in batch.get("events", []):
                ledger.event(run["id"], "remote_event", remote_kind=e["kind"], data=e["data"], remote_seq=e["seq"],
                             remote_time=e["time"], log_seq=record["seq"])
            by_segment: dict[int, list[dict]] = {}
            for r in batch.get("metrics", []):
                r = dict(r)
                by_segment.setdefault(int(r.pop("segment")), []).append(r)
            for segment, rows in by_segment.items():
                ledger.add_metrics(run["id"], segment, rows)
            state = batch.get("run", state)
        if copied:
            ledger.event(run["id"], "remote_checkpoints_synced", checkpoints=copied)
        fields: dict = {}
        if state:
            fields = {k: state[k] for k in ("step", "loss", "segment", "total_steps") if k in state}
            if run["status"] not in STICKY and state.get("status"):
                fields["status"] = state["status"]
        if records:
            fields.update(remote_seq=records[-1]["seq"], remote_log_hash=records[-1]["hash"])
        ledger.update_run(run["id"], **fields)
