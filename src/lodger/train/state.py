"""The live state of one process training one run: what the loop steps (``TrainState``: model,
optimizer, precision, guard, data and its step plans, counters) and, apart from it, the
collaborators the loop is given (a synchroniser, a recorder, a checkpointer, the control), all
built here by ``Session``."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import durable, faults
from ..checkpoint import CheckpointStore
from ..ckpt_interval import interval_for
from ..config import JobConfig, job_hash
from ..control import Control
from ..data import DataFile, Sampler, TokenizedSet
from ..distributed import Ranks
from ..home import run_dir
from ..ledger import provenance as prov
from ..model import ModelSource
from . import holders
from .checkpointer import Checkpointer
from .determinism import configure_determinism
from .holders import Progress
from .limits import LimitWatch, apply_limits
from .objective import make_objective
from .record import Recorder
from .sync import DataParallelSync, LocalSync
from .throughput import StepWork

__all__ = ["Prepared", "Progress", "Session", "TrainState"]

REFERENCED = ("dpo", "kto")  # objectives measured against a reference model (ORPO has none)


@dataclass
class Prepared:
    """Everything validated before a run folder exists."""

    job: JobConfig
    source: ModelSource
    folder: Path
    tokenizer: Any
    tokenizer_sha: str
    train_file: DataFile
    eval_file: DataFile | None
    train_set: TokenizedSet
    eval_set: TokenizedSet | None
    train_indices: list[int]
    eval_indices: list[int]
    total_steps: int
    device: str = "cpu"
    planner: Any = None  # packing.Packer or PaddedPlanner: each step's examples from its position


@dataclass
class TrainState:
    """What the loop steps, and nothing that records, saves or synchronises (those are given to
    ``train`` apart). ``planner`` turns a sampler position into the step's micro-batches
    (packing.py); ``progress``, the guard, the optimizer, the weights and the scaler are what a
    checkpoint holds (holders.py)."""

    training: Any            # the job's [training] section
    every_steps: int | None  # [checkpoints] every_steps
    model: Any
    optimizer: Any
    precision: Any
    guard: Any
    planner: Any
    progress: Progress
    train_set: TokenizedSet
    eval_set: TokenizedSet | None
    eval_indices: list[int]
    pad_id: int
    device: str
    total_steps: int
    poisoned: Any = None     # test-only fault injection (faults.py)
    objective: Any = None    # what a step's loss is (objective.py); None: SFT


def make_sync(control, limits, job, ranks: Ranks):
    """The way of training: one process, or data parallel (a federated synchroniser, see sync.py,
    would be chosen here from its config)."""
    every = job.checkpoints.every_seconds
    if ranks.world_size == 1:
        return LocalSync(control, limits, every)
    return DataParallelSync(control, limits, every, ranks.rank, ranks.world_size)


def choose_attention(prepared: Prepared, model) -> tuple[Any, str]:
    """The planner this process trains with and how packed examples are kept apart: "segments"
    (on the CPU: attention runs per example, attention.py), "position_ids" (transformers reads
    restarting position ids and masks the row), "mask" (an explicit block-causal mask), or
    "unpacked". A probe of the real model on its device (packing.attention_mode);
    ``packing = "auto"`` falls back to unpacked batches when nothing keeps examples apart."""
    from ..errors import JobFileError
    from ..packing import attention_mode, make_planner
    from .attention import SEGMENTS, set_attention

    planner, training = prepared.planner, prepared.job.training
    if planner is None or not planner.packed:
        return planner, "unpacked"
    if prepared.device == "cpu" and set_attention(model, SEGMENTS):
        if attention_mode(model) == "position_ids":
            planner.segments = True
            return planner, "segments"
        set_attention(model, "sdpa")  # the probe found examples mixed: transformers' own, probed below
    mode = attention_mode(model)
    if mode is None and training.packing is True:
        raise JobFileError("[training] packing = true, but this model's attention mixes packed examples "
                           "(neither restarting position ids nor a block mask keep them apart); set "
                           'packing = "auto" or false')
    if mode is None:  # "auto": the same steps' examples, one per row
        unpacked = make_planner(training, prepared.job.data.max_length, planner.sampler, [], False)
        unpacked.unpacked_padding = planner.unpacked_padding
        return unpacked, "unpacked"
    planner.explicit_mask = mode == "mask"
    return planner, mode


class Session:
    """The live state of one process training one run. Rank 0 is the run (ledger, metrics, log,
    checkpoints); other ranks have no ledger and write nothing."""

    def __init__(self, run_id: str, prepared: Prepared, ledger, quiet: bool = False,
                 control: Control | None = None, ranks: Ranks = Ranks()):
        import torch

        from ..model import attach_method, load_base_model
        from ..rng import seed_everything
        from .guard import Guard
        from .optim import build_optimizer
        from .precision import Precision

        self.run_id, self.p, self.ledger, self.quiet = run_id, prepared, ledger, quiet
        self.job = job = prepared.job
        self.dir = run_dir(run_id)
        self.rank, self.world_size = ranks.rank, ranks.world_size
        self.control = control or Control(self.dir)
        self.device = prepared.device
        self.applied_limits = apply_limits(job.limits)
        torch.set_num_threads(job.training.threads)
        configure_determinism(self.device)
        seed_everything(job.training.seed)
        base = load_base_model(prepared.folder)
        if job.training.gradient_checkpointing:
            # non-reentrant checkpointing restores the RNG for the recomputation, so dropout stays exact
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            base.enable_input_require_grads()
        self.model = attach_method(base, job.method, job.training.seed).to(self.device)
        self.planner, self.packing_mode = choose_attention(prepared, self.model)  # draws no global randomness
        if self.rank > 0:  # same weights on every rank (seeded above); then its own dropout stream
            from ..distributed import rank_seed

            seed_everything(rank_seed(job.training.seed, self.rank))
        self.precision = Precision(job.training.precision, self.device)
        self.guard = Guard(job.guard)
        self.poisoned = faults.poisoned_lines()  # test-only fault injection (faults.py)
        self.optimizer = build_optimizer([q for q in self.model.parameters() if q.requires_grad], job.training)
        self.meter = prov.ComputeMeter()
        self.fingerprint = prov.numerics_fingerprint(self.device)
        self.limits = LimitWatch(job, self.device, self.dir, self.control, self.meter)
        self.sync = make_sync(self.control, self.limits, job, ranks)
        # "auto" reads and records in the run's ledger, which only rank 0 has (ckpt_interval.py)
        self.sync.interval = interval_for(job.checkpoints.every_seconds, ledger if ranks.rank == 0 else None, run_id)
        checkpoints, keep = self.dir / "checkpoints", job.checkpoints.keep_last
        store = CheckpointStore(checkpoints, keep, self.world_size) if self.rank == 0 else None
        self.sync.barrier()  # rank 0 has created the checkpoints folder; the others may not race it
        self.store = store or CheckpointStore(checkpoints, keep, self.world_size)
        self.train_set, self.eval_set = prepared.train_set, prepared.eval_set
        self.eval_indices = prepared.eval_indices
        self.total_steps = prepared.total_steps
        self.pad_id = prepared.tokenizer.pad_token_id
        self.progress = Progress()
        self.recorder = Recorder(run_id, self.dir, ledger, self.control, self.progress, self.total_steps,
                                 job.training.log_every, writes=self.sync.writes)
        self.recorder.work = StepWork(self.model, rows=job.training.batch_size * job.training.grad_accum,
                                      threads=job.training.threads, precision=job.training.precision,
                                      device=self.device, world=job.training.world_size)  # MFU on the step line
        facts = holders.RunFacts(run_id, prepared, self.fingerprint)
        state = {"facts": facts, "weights": holders.Weights(self.model, job.method),
                 "optimizer": holders.Optimizer(self.optimizer), "rng": holders.Rng(self.sync),
                 "progress": self.progress, "evals": holders.Evals(self.recorder),
                 "guard": holders.GuardHolder(self.guard), "scaler": holders.Scaler(self.precision)}
        if job.method.objective in REFERENCED:
            state["reference"] = holders.Reference(self.train_set, self.eval_set)
        self.checkpointer = Checkpointer(run_id, self.store, state, facts, self.sync, self.recorder, ledger,
                                         self.meter)
        self.state = TrainState(job.training, job.checkpoints.every_steps, self.model, self.optimizer,
                                self.precision, self.guard, self.planner, self.progress, self.train_set,
                                self.eval_set, self.eval_indices, self.pad_id, self.device, self.total_steps,
                                self.poisoned, make_objective(job.method))

    def ready_reference(self, say) -> None:
        """DPO/KTO: the reference log-probabilities before step 1, unless a restored checkpoint
        brought them (reference.py). Called once the newest checkpoint, if any, is restored: a
        run starting from step 0 still has the model of step 0, which is the reference."""
        if self.job.method.objective not in REFERENCED:
            return
        from .reference import ready

        if self.progress.step and self.train_set.reference is None:  # restored without one: never by the contract
            from ..errors import RunStateError

            raise RunStateError(f"run {self.run_id}: its checkpoint at step {self.progress.step} holds no "
                                "reference table; start a new run")
        ready(self.model, self.p, precision=self.precision, device=self.device, pad_id=self.pad_id, say=say)

    def collaborators(self) -> dict:
        """What ``train`` is given besides the state, by its keyword names."""
        return {"checkpointer": self.checkpointer, "recorder": self.recorder, "control": self.control,
                "sync": self.sync}

    def write_adapter(self) -> Path:
        """The final trainable weights in their own folder (peft layout for LoRA), atomically."""
        from ..model import adapter_files

        final = self.dir / "adapter"
        durable.write_folder(final, adapter_files(self.model, self.job.method), tmp_prefix=".adapter-tmp-",
                             replace=True)
        return final

    def provenance(self) -> dict:
        p = self.p
        data = {"train": {"path": str(p.train_file.path), "sha256": p.train_file.sha256, "bytes": p.train_file.size,
                          "lines": len(p.train_file.rows)}}
        if p.eval_file is not None:
            data["eval"] = {"path": str(p.eval_file.path), "sha256": p.eval_file.sha256,
                            "bytes": p.eval_file.size, "lines": len(p.eval_file.rows)}
        eval_id = hashlib.sha256(json.dumps([p.eval_file.sha256 if p.eval_file else p.train_file.sha256,
                                             p.eval_indices]).encode()).hexdigest()
        data["eval_set_sha256"] = eval_id
        data["train_examples"], data["eval_examples"] = len(p.train_indices), len(p.eval_indices)
        # How examples were laid out: packed and unpacked steps hold the same examples, but sum the
        # loss in another order (compare.py checks it). unpacked_padding is what "auto" decided on.
        data["packing"] = {"setting": self.job.training.packing, "mode": self.packing_mode,
                           "pack_tokens": getattr(self.planner, "row_tokens", None) if self.planner.packed else None,
                           "unpacked_padding": None if self.planner.unpacked_padding is None
                           else round(self.planner.unpacked_padding, 4)}
        data["order"] = self.job.training.order  # which examples share a step (compare.py checks it)
        for use in self.job.data_uses():  # registered dataset (name, license, owner) or not
            if use.role in data:
                data[use.role].update(use.provenance())
        model = {"source": p.source.spec, "kind": p.source.kind, "path": str(p.source.path),
                 "sha256": p.source.sha256, "tokenizer_sha256": p.tokenizer_sha, **p.source.provenance()}
        if getattr(self.job.method, "init_adapter", None) is not None:
            from ..model import adapter_hash

            model["init_adapter"] = {"path": str(self.job.method.init_adapter),
                                     "sha256": adapter_hash(self.job.method.init_adapter)}
        return prov.capture(job=self.job.resolved_dict(), job_hash=job_hash(self.job),
                            job_dir=Path(os.getcwd()), model=model, data=data,
                            seeds={"seed": self.job.training.seed}, device=self.device,
                            segment=self.progress.segment)
