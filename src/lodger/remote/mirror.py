"""The worker's side of storage: what it pushes out while its training process runs, and what a
fresh node pulls in before it resumes (no torch).

Each push (``Mirror.push``) appends at most one ``batch`` record to the run's event log: the
ledger events, metric rows and run state that are new since the last one. On object storage it
also commits new checkpoints (every file, then the manifest: ``Storage.commit_folder``), prunes
old ones (manifest first, so a half-deleted one does not exist), uploads metrics.jsonl, log.txt,
provenance.json and the final adapter, and copies the owner's pause requests from the bucket into
the run's control folder. On a shared folder the run writes those files in storage itself.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .. import durable
from ..errors import CheckpointError
from .place import run_key
from .storage import MANIFEST, Storage, StorageError, build_manifest, fetch, list_checkpoints, verify

FILES = ("metrics.jsonl", "log.txt", "provenance.json", "control/state.json")  # state: what the run says
REQUESTERS = ("user",)  # the owner's requests cross; an agent's lapse with its (local) pid anyway
STATE = ("step", "loss", "segment", "status", "total_steps")


class Mirror:
    """Pushes one run's news from its worker home into the run's storage."""

    def __init__(self, store: Storage, home: Path, run_id: str, submission_id: str, log):
        self.store, self.home, self.run_id, self.submission_id, self.log = store, Path(home), run_id, submission_id, log
        self.key = run_key(run_id)
        self.folder = self.home / "runs" / run_id
        last = _last_record(log)
        # A shared folder keeps the worker's ledger between submissions; a scratch home starts empty.
        self.ledger_seq = int(last.get("ledger_seq") or 0) if store.local else 0
        self.marks = {k: tuple(v) for k, v in (last.get("marks") or {}).items()}
        self.state: dict | None = None
        self.sent: dict[str, str] = {}  # file name -> sha256 last uploaded
        self.checkpoints = set() if store.local else {c.step for c in list_checkpoints(store, f"{self.key}/checkpoints")}
        self.adapter_done = store.local

    def push(self) -> None:
        if not store_ready(self.home, self.run_id):
            return
        if not self.store.local:
            self._pull_requests()  # first: a pause should not wait behind uploads
        # The ledger is read before the files go up, so a batch never claims what is not in
        # storage yet: training commits a checkpoint before its ledger event, and a run records
        # `finished` after its last checkpoint and adapter (read the other way round, a sync could
        # see `finished` while the last checkpoint was still on its way).
        snapshot = self._read_ledger()
        if not self.store.local:
            self._push_checkpoints()
            self._push_files()
        self._push_batch(*snapshot)

    # -- the event log -------------------------------------------------------------------------
    def _read_ledger(self) -> tuple[dict, list[dict], list[dict]]:
        """The run row, and the events and metric rows not pushed yet."""
        from ..ledger import Ledger

        with Ledger(self.home / "ledger.db") as ledger:
            run = ledger.run(self.run_id)
            events = [e for e in ledger.events(self.run_id) if e["seq"] > self.ledger_seq]
            rows = [r for kind in ("train", "eval") for r in ledger.metrics(self.run_id, kind)
                    if (r["segment"], r["step"]) > self.marks.get(kind, (-1, -1))]
        return run, events, rows

    def _push_batch(self, run: dict, events: list[dict], rows: list[dict]) -> None:
        batch: dict = {}
        if events:
            batch["events"] = [{k: e[k] for k in ("seq", "time", "kind", "data")} for e in events]
        if rows:
            batch["metrics"] = rows
            for r in rows:
                kind = r.get("kind", "train")
                self.marks[kind] = max(self.marks.get(kind, (-1, -1)), (r["segment"], r["step"]))
        state = {k: run[k] for k in STATE}
        if state != self.state:
            batch["run"] = state
        if not batch:
            return
        self.ledger_seq = events[-1]["seq"] if events else self.ledger_seq
        batch.update(ledger_seq=self.ledger_seq, marks={k: list(v) for k, v in self.marks.items()},
                     submission=self.submission_id)
        self.log.append("batch", batch)
        self.state = state

    # -- object storage only -------------------------------------------------------------------
    def _push_checkpoints(self) -> None:
        local = Storage.open(str(self.folder))
        here = list_checkpoints(local, "checkpoints")
        for ckpt in reversed(here):  # oldest first: the newest is committed last
            if ckpt.step in self.checkpoints:
                continue
            try:
                files = verify(local, ckpt)
            except CheckpointError:
                continue  # pruned under us; its successor comes next time
            self.store.commit_folder(f"{self.key}/checkpoints/step-{ckpt.step:08d}", files, ckpt.manifest)
            self.checkpoints.add(ckpt.step)
        if here:
            oldest = min(c.step for c in here)
            for step in sorted(s for s in self.checkpoints if s < oldest):
                folder = f"{self.key}/checkpoints/step-{step:08d}"
                self.store.delete(f"{folder}/{MANIFEST}")  # first: from here on it does not exist
                self.store.delete(folder, recursive=True)
                self.checkpoints.discard(step)

    def _push_files(self) -> None:
        for name in FILES:
            try:
                data = (self.folder / name).read_bytes()
            except OSError:
                continue
            digest = hashlib.sha256(data).hexdigest()
            if self.sent.get(name) != digest:
                self.store.write_bytes(f"{self.key}/{name}", data)
                self.sent[name] = digest
        adapter = self.folder / "adapter"
        if not self.adapter_done and adapter.is_dir():
            files = {p.name: p.read_bytes() for p in sorted(adapter.iterdir()) if p.is_file()}
            try:
                self.store.commit_folder(f"{self.key}/adapter", files, build_manifest(files))
            except StorageError:
                if not self.store.exists(f"{self.key}/adapter/{MANIFEST}"):
                    raise
            self.adapter_done = True

    def _pull_requests(self) -> None:
        from ..owner.control import control_dir, wake

        changed = False
        for requester in REQUESTERS:
            path = control_dir(self.folder) / f"{requester}.json"
            try:
                body = self.store.read_bytes(f"{self.key}/control/{requester}.json")
                json.loads(body)
            except FileNotFoundError:
                body = None
            except ValueError:
                continue  # not a request lodger wrote
            try:
                held = path.read_bytes()
            except OSError:
                held = None
            if body == held:
                continue
            changed = True
            if body is None:
                durable.remove(path)
            else:
                durable.atomic_write(durable.make_dirs(path.parent) / path.name, body)
        if changed:
            wake(self.folder)


def store_ready(home: Path, run_id: str) -> bool:
    """Whether the training process created its run yet (its ledger and job file are there)."""
    return (Path(home) / "ledger.db").is_file() and (Path(home) / "runs" / run_id / "job.toml").is_file()


def _last_record(log) -> dict:
    seq, _ = log.head()
    if not seq:
        return {}
    return json.loads(log.storage.read_bytes(log.key(seq))).get("data", {})


def seed(store: Storage, run_id: str, folder: Path) -> int | None:
    """Before a resume on a fresh home: the newest checkpoint that verifies, metrics.jsonl and
    log.txt, from storage into the new run folder. Returns the checkpoint's step, or None."""
    key = run_key(run_id)
    for name in ("metrics.jsonl", "log.txt"):
        try:
            store.get_file(f"{key}/{name}", folder / name)
        except FileNotFoundError:
            pass
    durable.make_dirs(folder / "checkpoints")
    for ckpt in list_checkpoints(store, f"{key}/checkpoints"):
        try:
            fetch(store, ckpt, folder / "checkpoints")  # every byte verified, or nothing written
        except (CheckpointError, StorageError, FileNotFoundError):
            continue
        return ckpt.step
    return None


def download_tree(store: Storage, prefix: str, local: Path) -> None:
    """Copy every object under ``prefix`` into ``local`` (names checked by Storage.entries)."""
    durable.make_dirs(local)
    for name, size in store.entries(prefix).items():
        if size is None:
            download_tree(store, f"{prefix}/{name}", local / name)
        else:
            store.get_file(f"{prefix}/{name}", local / name)
