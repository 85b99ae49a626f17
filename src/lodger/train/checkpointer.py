"""Saving and restoring a training process's state: the holders' map (holders.py) to a committed
checkpoint folder and the ledger, back again, and rolling back to the last good one."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .. import durable
from ..checkpoint import Checkpoint, CheckpointStore, step_folder
from ..errors import CheckpointError
from .recovery import sync_metrics
from .holders import Entries, RunFacts, StateHolder, file_problems, split_entries

if TYPE_CHECKING:
    from ..ledger.provenance import ComputeMeter
    from .guard import Guard
    from .record import Recorder, RunRecords


class Checkpointer:
    """``holders``: the ordered map of named state holders; ``facts`` the one that checks what the
    checkpoint was trained on (its ``drift`` is what ``restore`` returns)."""

    def __init__(self, run_id: str, store: CheckpointStore, holders: dict[str, StateHolder], facts: RunFacts,
                 sync: Any, recorder: Recorder, ledger: RunRecords, meter: ComputeMeter, feed: Any = None):
        self.run_id, self.store, self.holders, self.facts = run_id, store, holders, facts
        self.sync, self.recorder, self.ledger, self.meter = sync, recorder, ledger, meter
        self.feed = feed  # [report] to: the trackers, told of each commit (reporting/feed.py), or None

    # -- saving ------------------------------------------------------------------------------
    def save(self, skip_if_exists: bool = False) -> Path:
        progress = self.recorder.progress
        existing = step_folder(self.store.root, progress.step)
        if skip_if_exists and existing.is_dir():  # single-process release only: ranks never skip alone
            return existing
        started = time.perf_counter()
        entries: dict = {}
        for holder in self.holders.values():  # every holder, on every rank (the RNG gather is collective)
            entries.update(holder.state_dict())
        if not self.sync.writes:
            self.sync.barrier()  # wait for rank 0's commit: no rank runs ahead of a checkpoint
            return existing
        files, state = split_entries(entries)
        files = {**{k: v for k, v in files.items() if not k.startswith("rng-rank-")},
                 "state.json": json.dumps(state, sort_keys=True).encode(),
                 **{k: v for k, v in files.items() if k.startswith("rng-rank-")}}
        sync_metrics(self.store.root.parent)  # the lines this checkpoint covers outlive it: resume re-ingests them
        path = self.store.save(progress.step, files)
        seconds = time.perf_counter() - started
        size = sum(f.stat().st_size for f in path.iterdir())
        durable.fault_point("checkpoint_before_ledger")
        pending = self.recorder.pending
        with self.ledger.transaction():
            self.ledger.add_metrics(self.run_id, progress.segment, pending)  # rows + their hashes
            # the event sets the run's step and loss columns (ledger/records.py): one record, chained
            self.ledger.event(self.run_id, "checkpoint", step=progress.step, path=path.name, bytes=size,
                              loss=next((r["loss"] for r in reversed(pending) if "loss" in r), None),
                              seconds=round(seconds, 4), compute=self.meter.read())
        durable.fault_point("checkpoint_after_ledger")
        self.recorder.pending = []
        if self.feed is not None:
            self.feed.committed()
        self.recorder.message(f"checkpoint step {progress.step} committed in {seconds:.2f} s "
                              f"({size / 2**20:.1f} MiB)")
        self.sync.barrier()
        return path

    # -- restoring ---------------------------------------------------------------------------
    def agreed(self, on_damaged: Callable[[Path, str, Path], None] | None = None) -> Checkpoint | None:
        """The newest good checkpoint, as every process agrees on it."""
        return self.sync.agree_checkpoint(self.store, self.check_contents, on_damaged)

    def check_contents(self, ckpt: Checkpoint) -> None:
        """Raise CheckpointError unless ``restore`` finds everything it reads: a checkpoint whose
        hashes verify can still lack a key (written by another version, or by hand), and is then
        damaged like any other, so resume falls back to the previous one. Every holder of the map
        says what it lacks (holders.py), for the world size the checkpoint's manifest records."""
        problems = file_problems(ckpt.files, "state.json")
        state = json.loads(ckpt.files["state.json"]) if not problems else {}
        entries = Entries(ckpt.files, state)
        for holder in self.holders.values():
            problems += holder.problems(entries, ckpt.step, ckpt.world_size)
        if problems:
            raise CheckpointError(f"{ckpt.path.name}: its files verify but cannot be restored: {'; '.join(problems)}")

    def restore(self, ckpt: Checkpoint) -> list[str]:
        """Load every holder from a verified checkpoint; return the drift found (if any)."""
        from ..distributed import refuse_other_world_size

        refuse_other_world_size(self.run_id, ckpt.world_size, self.sync.world_size)
        entries = Entries(ckpt.files, json.loads(ckpt.files["state.json"]))
        for holder in self.holders.values():
            holder.load_state_dict(entries)
        return self.facts.drift

    def rollback(self, guard: Guard) -> None:
        """Too many bad steps in a row: back to the last good checkpoint, lower lr, skip the bad batches."""
        from .guard import GuardState, TrainingDiverged

        carried = guard.start_rollback()  # raises TrainingDiverged after too many rollbacks
        bad_from = self.recorder.progress.step
        ckpt = self.agreed()
        if ckpt is None:
            raise TrainingDiverged(f"non-finite loss or gradient norm at steps {carried['bad_steps']} and no "
                                   "checkpoint to roll back to; lower [training] learning_rate or check the data")
        self.restore(ckpt)
        guard.state = GuardState(**carried)
        if not self.sync.writes:
            return
        self.recorder.truncate_metrics(ckpt.step)
        self.ledger.event(self.run_id, "rollback", from_step=bad_from, to_step=ckpt.step,
                          rollbacks=carried["rollbacks"], lr_scale=carried["lr_scale"],
                          skipped_batches=carried["skip_positions"], bad_steps=carried["bad_steps"])
        self.recorder.message(f"rollback {carried['rollbacks']}: steps {carried['bad_steps']} were non-finite; "
                              f"back to step {ckpt.step}, learning rate x{carried['lr_scale']:g}, bad batches "
                              "skipped")
