"""One process training one run, put together: ``Session`` is the composition root that builds the
training state (``train.state.TrainState``) and, apart from it, the collaborators the loop is
given (a synchroniser, a recorder, a checkpointer, the control), each from one builder, in the
order they depend on each other. Everything it needs is passed in at construction: the run's
ledger (rank 0 only), its control, its ranks and how to open its log."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .. import durable, faults
from ..config import job_hash
from ..owner.control import Control
from ..distributed import Ranks
from ..home import run_dir
from ..ledger import provenance as prov
from ..train import holders
from ..train.checkpointer import Checkpointer
from ..train.collaborators import Collaborators
from ..train.holders import Progress
from ..train.limits import LimitWatch
from ..train.objective import make_objective
from ..train.record import Recorder, RunRecords
from ..train.state import (TrainState, base_facts, build_feed, build_rewards, build_store, build_sync,
                           settle_process)
from ..train.throughput import StepWork
from .prepare import Prepared

if TYPE_CHECKING:
    from ..ledger import Ledger
    from ..reporting.report import Reporter
    from ..train.collaborators import Objective

OpenLog = Callable[[], "Reporter"]  # opens the run's log and takes the terminal from the phase before


def choose_attention(prepared: Prepared, model: Any) -> tuple[Any, str]:
    """The planner this process trains with and how packed examples are kept apart: "segments"
    (on the CPU: attention runs per example, attention.py), "position_ids" (transformers reads
    restarting position ids and masks the row), "mask" (an explicit block-causal mask), or
    "unpacked". A probe of the real model on its device (packing.attention_mode);
    ``packing = "auto"`` falls back to unpacked batches when nothing keeps examples apart."""
    from ..errors import JobFileError
    from ..data.packing import attention_mode, make_planner
    from ..train.attention import SEGMENTS, set_attention

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



def build_recorder(run_id: str, folder: Path, ledger: Ledger | None, control: Control, progress: Progress,
                   prepared: Prepared, model: Any, *, writes: bool, reporter: Reporter) -> Recorder:
    """What records the run, its log's reporter and the FLOPs of its steps (the step line's MFU),
    complete before anyone else holds it."""
    training = prepared.job.training
    recorder = Recorder(run_id, folder, ledger, control, progress,  # type: ignore[arg-type]  # None: writes nothing
                        prepared.total_steps, training.log_every, writes=writes)
    recorder.reporter = reporter
    recorder.work = StepWork(model, rows=training.batch_size * training.grad_accum, threads=training.threads or 1,
                             precision=training.precision, device=prepared.device, world=training.world_size)
    return recorder


def announce_holds(control: Control, ledger: RunRecords, run_id: str, progress: Progress,
                   reporter: Reporter) -> None:
    """A hold and its end go to the ledger and the log as they happen (rank 0, which has both)."""

    def on_hold(request: dict[str, Any]) -> None:
        ledger.set_status(run_id, "held", "held", step=progress.step, by=request.get("by"),
                          reason=request.get("reason"))
        reporter.held(request.get("by"), request.get("reason"))

    def on_continue(request: dict[str, Any], held: float) -> None:
        ledger.set_status(run_id, "running", "continued", step=progress.step, by=request.get("by"),
                          held_seconds=round(held, 3))
        reporter.continued(held)

    control.on_hold, control.on_continue = on_hold, on_continue


def build_objective(session: Session) -> Objective:
    """What a step's loss is (objective.py); GRPO's with what sampling and scoring need (grpo.py):
    for full fine-tuning with a KL term, a frozen copy of the base as the reference. With
    num_iterations > 1 the planner repeats the sampling step's plan until the next sampling."""
    job, prepared, rewards = session.job, session.p, session.rewards
    if job.grpo is None or rewards is None:  # both set exactly when objective = "grpo" (config: JobConfig._grpo_parts)
        return make_objective(job.method)
    from ..train.grpo import GRPO, RepeatPlanner

    reference = None
    if job.grpo.beta > 0 and job.method.kind == "full":
        from ..model import load_base_model

        reference = load_base_model(prepared.folder).eval().requires_grad_(False).to(session.device)
    objective = GRPO(job.grpo, rewards, tokenizer=prepared.tokenizer, dataset=session.train_set,
                     eval_set=session.eval_set, precision=session.precision, device=session.device, sync=session.sync,
                     progress=session.progress, reference=reference)
    if job.grpo.num_iterations > 1:
        session.planner = RepeatPlanner(session.planner, objective, session.progress)
    return objective


class Session:
    """The live state of one process training one run, and its composition root: each component is
    made by one builder below, in the order they depend on each other. Rank 0 is the run (ledger,
    metrics, log, checkpoints); other ranks have no ledger and write nothing. ``open_log`` is
    called once the model is loaded (the log's reporter takes the terminal from the phase that
    waited for it)."""

    def __init__(self, run_id: str, prepared: Prepared, ledger: Ledger | None, *, control: Control, ranks: Ranks,
                 open_log: OpenLog) -> None:
        from ..train.guard import Guard
        from ..train.optim import build_optimizer
        from ..train.precision import Precision

        self.run_id, self.p, self.ledger = run_id, prepared, ledger
        self.job = job = prepared.job
        self.dir = run_dir(run_id)
        self.rank, self.world_size = ranks.rank, ranks.world_size
        self.control = control
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
        self.rewards = build_rewards(job, self.control)
        self.objective = build_objective(self)
        reporter = open_log()
        self.recorder = build_recorder(run_id, self.dir, ledger, self.control, self.progress, prepared, self.model,
                                       writes=self.sync.writes, reporter=reporter)
        facts = holders.RunFacts(run_id, prepared, self.fingerprint, self.rewards.files() if self.rewards else None,
                                 base=self.base)
        state = holders.declare(facts=facts, model=self.model, method=job.method, optimizer=self.optimizer,
                                sync=self.sync, progress=self.progress, recorder=self.recorder, guard=self.guard,
                                precision=self.precision, train_set=self.train_set, eval_set=self.eval_set,
                                objective=self.objective)
        self.feed = build_feed(job, run_id, writes=ledger is not None and self.sync.writes)
        # ledger None on ranks > 0, which write nothing (the Recorder and Checkpointer check ``writes`` first)
        self.checkpointer = Checkpointer(run_id, self.store, state, facts, self.sync, self.recorder,
                                         ledger,  # type: ignore[arg-type]
                                         self.meter, self.feed)
        self.state = TrainState(
            training=job.training, every_steps=job.checkpoints.every_steps, model=self.model,
            optimizer=self.optimizer, precision=self.precision, guard=self.guard, planner=self.planner,
            progress=self.progress, train_set=self.train_set, eval_set=self.eval_set,
            eval_indices=self.eval_indices, pad_id=self.pad_id, device=self.device, total_steps=self.total_steps,
            poisoned=self.poisoned, objective=self.objective)
        if ledger is not None:
            announce_holds(self.control, ledger, run_id, self.progress, reporter)

    def ready_reference(self, say: Callable[[str], None]) -> None:
        """DPO/KTO: the reference log-probabilities before step 1, unless a restored checkpoint
        brought them (reference.py). Called once the newest checkpoint, if any, is restored: a
        run starting from step 0 still has the model of step 0, which is the reference."""
        if self.job.method.objective not in holders.REFERENCED:
            return
        from ..train.reference import ready

        # restored without one: never, by the contract (the holder's problems() make such a checkpoint damaged)
        if self.progress.step and getattr(self.train_set, "reference", None) is None:
            from ..errors import RunStateError

            raise RunStateError(f"run {self.run_id}: its checkpoint at step {self.progress.step} holds no "
                                "reference table; start a new run")
        ready(self.model, self.p, precision=self.precision, device=self.device, pad_id=self.pad_id, say=say)

    def collaborators(self) -> Collaborators:
        """What ``train`` is given besides the state, as one typed value."""
        return Collaborators(checkpointer=self.checkpointer, recorder=self.recorder, control=self.control,
                             sync=self.sync)

    def write_adapter(self) -> Path:
        """The final trainable weights in their own folder (peft layout for LoRA), atomically."""
        from ..model import adapter_files

        final = self.dir / "adapter"
        durable.write_folder(final, adapter_files(self.model, self.job.method), tmp_prefix=".adapter-tmp-",
                             replace=True)
        return final

    def provenance(self) -> dict[str, Any]:
        """What this segment of the run used: job, data, model, seeds, the device (ledger.provenance)."""
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
        # loss in another order (reporting/compare.py checks it). unpacked_padding is what "auto" decided on.
        data["packing"] = {"setting": self.job.training.packing, "mode": self.packing_mode,
                           "pack_tokens": getattr(self.planner, "row_tokens", None) if self.planner.packed else None,
                           "unpacked_padding": None if self.planner.unpacked_padding is None
                           else round(self.planner.unpacked_padding, 4)}
        data["order"] = self.job.training.order  # which examples share a step (reporting/compare.py checks it)
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
