"""The training loop: one function, read top to bottom.

Per optimizer step: the step's plan from its position (data/packing.py: packed rows or padded
micro-batches, a pure function of seed, epoch and position), learning rate, forward and backward
of this process's share with the loss normalised over the whole step's target tokens, the
synchroniser's ``finish_step``, clip, finite check, update, record, eval when due, checkpoint
when due or when asked to stop.

``train`` steps a ``TrainState`` (state.py) and calls the collaborators it is given
(``collaborators.Collaborators``, one typed value): ``sync``
(sync.py: one process, or several ranks, each taking its share of the step's plan and agreeing
once per step), ``recorder`` (record.py), ``checkpointer`` (checkpointer.py) and ``control``
(owner/control.py: hold, release, stop).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

from .. import faults
from ..owner.control import ReleaseRequested
from ..errors import StepFailed
from ..data.packing import padded_batch
from ..rng import capture as capture_rng
from ..rng import restore as restore_rng
from .optim import lr_at
from .record import StepRecord
from .step import install_yield_points, micro_step, optimizer_step  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from ..data.packing import StepPlan
    from .collaborators import Checkpointing, Collaborators, Controlling, Recording, Synchronising
    from .state import TrainState


def eval_due(st: "TrainState", step: int) -> bool:
    """Whether the schedule evaluates after ``step``: at the start, every ``eval_every`` steps, at the end."""
    every = st.training.eval_every
    return step in (0, st.total_steps) or bool(every and step % every == 0)


@torch.no_grad()
def evaluate(st: "TrainState", step: int, recorder: "Recording", control: "Controlling",
             rank: int = 0) -> tuple[float, dict] | None:
    """The objective's loss on the held-out set with its metrics (None when there is none): SFT's
    token-weighted mean loss; a preference objective's loss over every held-out example.

    The yield points stay live here: a hold waits inside the eval, and a release abandons it
    (``ReleaseRequested`` goes up to ``train``). An eval changes no state and draws no randomness,
    so the checkpoint of the last finished step is exact, and a resume runs the eval again."""
    if st.eval_set is None or not st.eval_indices or rank != 0:
        return None  # rank 0 evaluates alone; the others never wait for it (no collective inside)
    size = st.training.batch_size
    starts = range(0, len(st.eval_indices), size)
    recorder.reporter.eval_started(step, len(st.eval_indices), len(starts))
    began = time.perf_counter()
    held_before = control.held_seconds
    st.model.eval()
    control.in_step = True  # a release here drops the eval (nothing to undo) instead of waiting for its end
    total: list[float] = []
    sums = None
    try:
        for done, start in enumerate(starts, 1):
            batch = padded_batch(st.eval_set, st.eval_indices[start:start + size], st.pad_id)
            [batch] = st.objective.prepare(st.model, [batch], None, None)  # GRPO: greedy completions, scored
            with st.precision.autocast():
                terms, batch_sums = st.objective.terms(st.model, batch, st.device)
            values = terms.reshape(-1).tolist()  # .tolist() syncs with the device; fine once per eval batch
            total = values if not total else [a + b for a, b in zip(total, values)]
            if batch_sums is not None:
                sums = batch_sums if sums is None else sums + batch_sums
            recorder.reporter.eval_progress(step, done, len(starts))
    finally:
        control.in_step = False
        st.model.train()
    recorder.eval_seconds = time.perf_counter() - began - (control.held_seconds - held_before)
    weights = st.objective.weights(st.eval_set, st.eval_indices)
    loss = st.objective.combine(total[0] if len(total) == 1 else total, weights)
    return float(loss), ({} if sums is None else st.objective.metrics(sums, weights))


def train(st: "TrainState", parts: "Collaborators") -> str:
    """Run from ``st.progress`` to the last step; return "finished", "interrupted" or "paused"
    (errors.StepFailed goes up after the last finished step's checkpoint is committed)."""
    checkpointer, recorder, control, sync = parts.checkpointer, parts.recorder, parts.control, parts.sync
    try:
        return _train_steps(st, checkpointer, recorder, control, sync)
    except ReleaseRequested:
        # Give the machine back now, with the state of the last finished step (a partial step has
        # been undone in _backward; an abandoned eval changed nothing and is run again on resume).
        control.in_step = False
        checkpointer.save(skip_if_exists=True)
        return "paused"
    except StepFailed:
        # The same, then the error goes up: the cause (a reward function, say) is the owner's to
        # fix, and `lodger resume` goes on from this checkpoint, nothing lost.
        control.in_step = False
        if sync.saves_alone:  # with several ranks, the others wait inside a collective: torchrun ends them
            checkpointer.save(skip_if_exists=True)
        raise


def _backward(st: "TrainState", plan: "StepPlan", control: "Controlling", sync: "Synchronising"
              ) -> tuple["torch.Tensor", "torch.Tensor | None", int, int, int, int, tuple[float, ...]]:
    """This process's micro-batches of the step, prepared (GRPO: completions sampled and scored),
    forward and backward: (summed loss of its share, its metric sums or None, positions computed,
    of which padding, keys attended (PackedBatch.attended), the whole step's target tokens and
    loss normalisers (every rank's))."""
    packs = plan.share(sync.rank, sync.world_size)
    batches = [st.planner.collate(st.train_set, pack, st.pad_id) for pack in packs]
    loss_sum = torch.zeros((), dtype=torch.float32, device=st.device)
    sums = None
    rng_at_step_start = capture_rng()  # a few KB copied; lets a release drop this step exactly
    try:
        control.in_step = True  # a release now drops this step
        batches = st.objective.prepare(st.model, batches, st.progress.step, plan.start)
        step_tokens = st.objective.target_tokens(st.train_set, plan.indices())
        weights = st.objective.weights(st.train_set, plan.indices())  # the loss's normalisers, likewise
        for pack, batch in zip(packs, batches):
            sync.micro_step()
            lines = [int(st.train_set.lines[i]) for row in pack for i in row] if st.poisoned else []
            loss, batch_sums = micro_step(st.objective, st.model, batch, st.precision, st.device, weights,
                                          faults.loss_factor(lines, st.poisoned))
            loss_sum += loss
            if batch_sums is not None:
                sums = batch_sums if sums is None else sums + batch_sums
    except (ReleaseRequested, StepFailed):
        # Forget this step's partial work as if it never began, so the checkpoint (written by
        # train()) equals the state at the step boundary and resuming stays exact.
        st.optimizer.zero_grad(set_to_none=True)
        restore_rng(*rng_at_step_start)
        raise
    control.in_step = False
    computed = sum(b.positions for b in batches)
    return (loss_sum, sums, computed, computed - sum(b.tokens for b in batches), sum(b.attended for b in batches),
            step_tokens, weights)


def _finish(sync: "Synchronising", params: list[torch.nn.Parameter], loss_sum: torch.Tensor, sums: torch.Tensor | None,
            last_save: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The synchroniser's end of the step (several ranks: one all-reduce), the metric sums with the loss."""
    if sums is None:
        return sync.finish_step(params, loss_sum, last_save), None
    # In the sums' dtype (GRPO's are float64: a reward's std from its sum of squares needs it), the
    # loss going through it and back unchanged.
    both = sync.finish_step(params, torch.cat([loss_sum.reshape(1).to(sums), sums]), last_save)
    return both[0].to(loss_sum), both[1:]


def _train_steps(st: "TrainState", ckpt: "Checkpointing", rec: "Recording", control: "Controlling",
                 sync: "Synchronising") -> str:
    cfg, p, guard, planner = st.training, st.progress, st.guard, st.planner
    params = [q for q in st.model.parameters() if q.requires_grad]
    max_norm = cfg.max_grad_norm or math.inf  # 0 disables clipping; the norm is still measured
    st.model.train()
    if sync.start(st.model):
        return "interrupted"
    if eval_due(st, p.step) and not rec.has_eval_at(p.step):
        # The first eval, or one that a release abandoned (the checkpoint it left has no result for it).
        rec.eval(p.step, evaluate(st, p.step, rec, control, sync.rank))
        if p.step == st.total_steps and rec.has_eval_at(p.step) and sync.saves_alone:
            ckpt.save()  # the last checkpoint carries the final eval, as in an uninterrupted run
    last_save = time.monotonic()
    while p.step < st.total_steps:
        started, held_before = time.perf_counter(), control.held_seconds
        p.position = planner.next_start(p.position, guard.state.skip_positions)  # past batches a rollback banned
        plan = planner.plan(p.position)
        lr = lr_at(p.step, st.total_steps, cfg) * guard.state.lr_scale
        for group in st.optimizer.param_groups:
            group["lr"] = lr
        loss_sum, sums, computed, padded, attended, step_tokens, weights = _backward(st, plan, control, sync)
        loss_sum, sums = _finish(sync, params, loss_sum, sums, last_save)
        loss_value, norm_value, finite, overflow = optimizer_step(params, st.optimizer, st.precision, max_norm,
                                                                  loss_sum)
        verdict, zscore = guard.after_step(p.step + 1, p.position, loss_value, finite)
        p.step += 1
        p.position = plan.end
        p.tokens += step_tokens
        held = control.held_seconds - held_before  # the owner's time, not the step's: reported apart
        rec.step(StepRecord(
            step=p.step, loss=loss_value, grad_norm=norm_value, lr=lr, tokens=step_tokens,
            seconds=time.perf_counter() - started - held, held=held, skipped=not finite or overflow,
            samples=None if finite else tuple(int(st.train_set.lines[i]) for i in plan.indices()),
            computed=computed, padded=padded, attended=attended,
            metrics={} if sums is None else st.objective.metrics(sums, weights)))
        if verdict == "spike":
            rec.spike(p.step, loss_value, zscore)
        if verdict == "rollback":
            ckpt.rollback(guard)
            last_save = time.monotonic()
            continue
        if cfg.eval_every and p.step % cfg.eval_every == 0 and p.step < st.total_steps:
            rec.eval(p.step, evaluate(st, p.step, rec, control, sync.rank))
        every = st.every_steps
        due = (every and p.step % every == 0) or sync.save_due(last_save)
        if p.step == st.total_steps:
            rec.eval(p.step, evaluate(st, p.step, rec, control, sync.rank))
        if guard.state.bad_in_row:
            due = False  # never commit a state in the middle of a run of bad steps
        stopping, release = sync.stopping(), sync.releasing()
        if due or stopping or release or p.step == st.total_steps:
            ckpt.save()
            last_save = time.monotonic()
        if release and p.step < st.total_steps:
            return "paused"
        if stopping and p.step < st.total_steps:
            return "interrupted"
    return "finished"
