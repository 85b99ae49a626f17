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
from typing import TYPE_CHECKING, Any

from .. import durable, faults
from ..checkpoint import CheckpointStore
from ..ckpt_interval import interval_for
from ..config import JobConfig, job_hash
from ..control import Control
from ..data import DataFile, TokenizedSet
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

if TYPE_CHECKING:
    from .collaborators import Objective, Planning

__all__ = ["Prepared", "Progress", "Session", "TrainState"]


@dataclass(frozen=True)
class Prepared:
    """Everything validated before a run folder exists (lifecycle.run.prepare_job): one value, taken as it is
    by every later stage."""

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


@dataclass(kw_only=True)
class TrainState:
    """What the loop steps, and nothing that records, saves or synchronises (those are given to
    ``train`` apart). Keyword-only: its fields are many and alike. ``planner`` turns a sampler position into the
    step's micro-batches
    (packing.py); ``progress``, the guard, the optimizer, the weights and the scaler are what a
    checkpoint holds (holders.py)."""

    training: Any            # the job's [training] section
    every_steps: int | None  # [checkpoints] every_steps
    model: Any
    optimizer: Any
    precision: Any
    guard: Any
    planner: "Planning"
    progress: Progress
    train_set: TokenizedSet
    eval_set: TokenizedSet | None
    eval_indices: list[int]
    pad_id: int
    device: str
    total_steps: int
    poisoned: Any = None     # test-only fault injection (faults.py)
    objective: "Objective"   # what a step's loss is (objective.py)


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


def settle_process(job, device: str) -> dict:
    """This process as the job wants it before anything is built: its limits (returned as
    applied), torch's threads, the determinism settings, every generator seeded."""
    import torch

    from ..rng import seed_everything

    applied = apply_limits(job.limits)
    torch.set_num_threads(job.training.threads)
    configure_determinism(device)
    seed_everything(job.training.seed)
    return applied


def build_model(prepared: Prepared, rank: int = 0) -> tuple[Any, Any, str]:
    """The model with its method attached, on its device; the planner and how packed examples are
    kept apart (``choose_attention``). Rank r > 0 then reseeds its own dropout stream."""
    from ..model import attach_method, load_base_model
    from ..rng import seed_everything

    job = prepared.job
    base = load_base_model(prepared.folder, job.method, prepared.device, job.training.precision)
    if job.training.gradient_checkpointing:
        # non-reentrant checkpointing restores the RNG for the recomputation, so dropout stays exact
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
    model = attach_method(base, job.method, job.training.seed).to(prepared.device)
    planner, packing_mode = choose_attention(prepared, model)  # draws no global randomness
    if rank > 0:  # same weights on every rank (seeded above); then its own dropout stream
        from ..distributed import rank_seed

        seed_everything(rank_seed(job.training.seed, rank))
    return model, planner, packing_mode


def base_facts(method, model) -> dict | None:
    """[method] base_bits: the quantised base as provenance and the checkpoint record it (quant.facts)."""
    if getattr(method, "base_bits", None) is None:
        return None
    from ..quant import facts

    return facts(method.base_bits, model)


def build_sync(control, limits, job, ranks: Ranks, ledger, run_id: str):
    """The way of training (``make_sync``) with its checkpoint interval: "auto" reads and records in
    the run's ledger, which only rank 0 has (ckpt_interval.py)."""
    sync = make_sync(control, limits, job, ranks)
    sync.interval = interval_for(job.checkpoints.every_seconds, ledger if ranks.rank == 0 else None, run_id)
    return sync


def build_store(folder: Path, job, ranks: Ranks, sync) -> CheckpointStore:
    """The run's checkpoint store: rank 0 creates the folder first, the others after a barrier."""
    checkpoints, keep = folder / "checkpoints", job.checkpoints.keep_last
    store = CheckpointStore(checkpoints, keep, ranks.world_size) if ranks.rank == 0 else None
    sync.barrier()  # rank 0 has created the checkpoints folder; the others may not race it
    return store or CheckpointStore(checkpoints, keep, ranks.world_size)


def build_recorder(run_id: str, folder: Path, ledger, control, progress: Progress, prepared: Prepared, model, *,
                   writes: bool) -> Recorder:
    """What records the run, with the FLOPs of its steps for the step line's MFU."""
    training = prepared.job.training
    recorder = Recorder(run_id, folder, ledger, control, progress, prepared.total_steps, training.log_every,
                        writes=writes)
    recorder.work = StepWork(model, rows=training.batch_size * training.grad_accum, threads=training.threads or 1,
                             precision=training.precision, device=prepared.device, world=training.world_size)
    return recorder


def build_feed(job, run_id: str, *, writes: bool):
    """[report] to: the trackers told of each checkpoint's commit (report_feed.py), on the process
    that records the run; None when there are none."""
    if not job.report.to or not writes:
        return None
    from ..report_feed import TrackerFeed

    return TrackerFeed(run_id, job.report)


def build_rewards(job, control):
    """GRPO's reward functions (rewards/), waiting on them answering the owner's hold or release."""
    if job.method.objective != "grpo":
        return None
    from ..rewards import Rewards

    return Rewards(job.rewards, job.grpo, poll=control.yield_point)


def build_objective(session: "Session"):
    """What a step's loss is (objective.py); GRPO's with what sampling and scoring need (grpo.py):
    for full fine-tuning with a KL term, a frozen copy of the base as the reference. With
    num_iterations > 1 the planner repeats the sampling step's plan until the next sampling."""
    job, prepared = session.job, session.p
    if job.grpo is None:  # set exactly when objective = "grpo" (config: JobConfig._grpo_parts)
        return make_objective(job.method)
    from .grpo import GRPO, RepeatPlanner

    reference = None
    if job.grpo.beta > 0 and job.method.kind == "full":
        from ..model import load_base_model

        reference = load_base_model(prepared.folder).eval().requires_grad_(False).to(session.device)
    objective = GRPO(job.grpo, session.rewards, tokenizer=prepared.tokenizer, dataset=session.train_set,
                     eval_set=session.eval_set, precision=session.precision, device=session.device, sync=session.sync,
                     progress=session.progress, reference=reference)
    if job.grpo.num_iterations > 1:
        session.planner = RepeatPlanner(session.planner, objective, session.progress)
    return objective


class Session:
    """The live state of one process training one run, and its composition root: each component is
    made by one builder below, in the order they depend on each other. Rank 0 is the run (ledger,
    metrics, log, checkpoints); other ranks have no ledger and write nothing."""

    def __init__(self, run_id: str, prepared: Prepared, ledger, quiet: bool = False,
                 control: Control | None = None, ranks: Ranks = Ranks()):
        from .guard import Guard
        from .optim import build_optimizer
        from .precision import Precision

        self.run_id, self.p, self.ledger, self.quiet = run_id, prepared, ledger, quiet
        self.job = job = prepared.job
        self.dir = run_dir(run_id)
        self.rank, self.world_size = ranks.rank, ranks.world_size
        self.control = control or Control(self.dir)
        self.device = prepared.device
        self.applied_limits = settle_process(job, self.device)
        self.model, self.planner, self.packing_mode = build_model(prepared, ranks.rank)
        self.base = base_facts(job.method, self.model)
        self.precision = Precision(job.training.precision, self.device)
        self.guard = Guard(job.guard)
        self.poisoned = faults.poisoned_lines()  # test-only fault injection (faults.py)
        self.optimizer = build_optimizer([q for q in self.model.parameters() if q.requires_grad], job.training)
        self.meter = prov.ComputeMeter()
        self.fingerprint = prov.numerics_fingerprint(self.device)
        self.limits = LimitWatch(job, self.device, self.dir, self.control, self.meter)
        self.sync = build_sync(self.control, self.limits, job, ranks, ledger, run_id)
        self.store = build_store(self.dir, job, ranks, self.sync)
        self.train_set, self.eval_set = prepared.train_set, prepared.eval_set
        self.eval_indices = prepared.eval_indices
        self.total_steps = prepared.total_steps
        self.pad_id = prepared.tokenizer.pad_token_id
        self.progress = Progress()
        self.recorder = build_recorder(run_id, self.dir, ledger, self.control, self.progress, prepared, self.model,
                                       writes=self.sync.writes)
        self.rewards = build_rewards(job, self.control)
        self.objective = build_objective(self)
        facts = holders.RunFacts(run_id, prepared, self.fingerprint, self.rewards.files() if self.rewards else None,
                                 base=self.base)
        state = holders.declare(facts=facts, model=self.model, method=job.method, optimizer=self.optimizer,
                                sync=self.sync, progress=self.progress, recorder=self.recorder, guard=self.guard,
                                precision=self.precision, train_set=self.train_set, eval_set=self.eval_set,
                                objective=self.objective)
        self.feed = build_feed(job, run_id, writes=ledger is not None and self.sync.writes)
        self.checkpointer = Checkpointer(run_id, self.store, state, facts, self.sync, self.recorder, ledger,
                                         self.meter, self.feed)
        self.state = TrainState(
            training=job.training, every_steps=job.checkpoints.every_steps, model=self.model,
            optimizer=self.optimizer, precision=self.precision, guard=self.guard, planner=self.planner,
            progress=self.progress, train_set=self.train_set, eval_set=self.eval_set,
            eval_indices=self.eval_indices, pad_id=self.pad_id, device=self.device, total_steps=self.total_steps,
            poisoned=self.poisoned, objective=self.objective)

    def ready_reference(self, say) -> None:
        """DPO/KTO: the reference log-probabilities before step 1, unless a restored checkpoint
        brought them (reference.py). Called once the newest checkpoint, if any, is restored: a
        run starting from step 0 still has the model of step 0, which is the reference."""
        if self.job.method.objective not in holders.REFERENCED:
            return
        from .reference import ready

        # restored without one: never, by the contract (the holder's problems() make such a checkpoint damaged)
        if self.progress.step and getattr(self.train_set, "reference", None) is None:
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
        data: dict[str, Any] = {"train": {"path": str(p.train_file.path), "sha256": p.train_file.sha256,
                                          "bytes": p.train_file.size,
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
        if self.base is not None:  # what the quantisation was, by which library, and its result's sha256
            model["quantisation"] = self.base
        init_adapter = getattr(self.job.method, "init_adapter", None)
        if init_adapter is not None:
            from ..model import adapter_hash

            model["init_adapter"] = {"path": str(init_adapter), "sha256": adapter_hash(init_adapter)}
        if self.rewards is not None:  # GRPO: each reward, and the sha256 of the owner's own files
            data["rewards"] = self.rewards.provenance()
        return prov.capture(job=self.job.resolved_dict(), job_hash=job_hash(self.job),
                            job_dir=Path(os.getcwd()), model=model, data=data,
                            seeds={"seed": self.job.training.seed}, device=self.device,
                            segment=self.progress.segment)
