"""The training loop: one function, read top to bottom.

Per optimizer step: learning rate, the step's micro-batches from the sampler, forward and
backward with the loss normalised over the whole step's target tokens, the synchroniser's
``finish_step``, clip, finite check, update, log, eval when due, checkpoint when due or when asked
to stop.

The loop calls what the state (state.py) was built with: ``s.sync`` (sync.py: one process, or
several ranks, each taking slots ``rank::world`` of the step's global example order and agreeing
once per step), ``s.recorder`` (record.py) and ``s.checkpointer`` (checkpointer.py).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

from .. import faults
from ..control import ReleaseRequested
from ..data import collate
from ..rng import capture as capture_rng
from ..rng import restore as restore_rng
from .optim import lr_at
from .step import install_yield_points, micro_step, optimizer_step, token_loss_sum  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from .state import Session


def eval_due(s: "Session", step: int) -> bool:
    """Whether the schedule evaluates after ``step``: at the start, every ``eval_every`` steps, at the end."""
    every = s.job.training.eval_every
    return step in (0, s.total_steps) or bool(every and step % every == 0)


@torch.no_grad()
def evaluate(s: "Session", step: int) -> float | None:
    """Token-weighted mean loss on the held-out set (None when there is none).

    The yield points stay live here: a hold waits inside the eval, and a release abandons it
    (``ReleaseRequested`` goes up to ``train``). An eval changes no state and draws no randomness,
    so the checkpoint of the last finished step is exact, and a resume runs the eval again."""
    if s.eval_set is None or not s.eval_indices or s.rank != 0:
        return None  # rank 0 evaluates alone; the others never wait for it (no collective inside)
    size = s.job.training.batch_size
    starts = range(0, len(s.eval_indices), size)
    s.recorder.reporter.eval_started(step, len(s.eval_indices), len(starts))
    began = time.perf_counter()
    held_before = s.control.held_seconds
    s.model.eval()
    s.control.in_step = True  # a release here drops the eval (nothing to undo) instead of waiting for its end
    total, count = 0.0, 0
    try:
        for start in starts:
            batch = collate(s.eval_set, s.eval_indices[start:start + size], s.pad_id)
            with s.precision.autocast():
                loss, n = token_loss_sum(s.model, {k: v.to(s.device) for k, v in batch.items()})
            total += loss.item()  # .item() syncs with the device; fine once per eval batch
            count += n
    finally:
        s.control.in_step = False
        s.model.train()
    s.recorder.eval_seconds = time.perf_counter() - began - (s.control.held_seconds - held_before)
    return total / max(count, 1)


def train(s: "Session") -> str:
    """Run from ``s.progress`` to the last step; return "finished", "interrupted" or "paused"."""
    try:
        return _train_steps(s)
    except ReleaseRequested:
        # Give the machine back now, with the state of the last finished step (a partial step has
        # been undone in _backward; an abandoned eval changed nothing and is run again on resume).
        s.control.in_step = False
        s.checkpointer.save(skip_if_exists=True)
        return "paused"


def _backward(s: "Session", ids: list[int], step_tokens: int, micro: int, accum: int) -> tuple[torch.Tensor, int, int]:
    """The step's micro-batches, forward and backward; the summed loss of this process's share,
    the positions it computed and the padding among them."""
    batches = [collate(s.train_set, ids[i * micro:(i + 1) * micro], s.pad_id) for i in range(accum)]
    computed = sum(b["input_ids"].numel() for b in batches)
    padded = computed - sum(int(b["attention_mask"].sum()) for b in batches)
    loss_sum = torch.zeros((), dtype=torch.float32, device=s.device)
    rng_at_step_start = capture_rng()  # a few KB copied; lets a release drop this step exactly
    try:
        s.control.in_step = True  # a release now drops this step
        for index, batch in enumerate(batches):
            s.sync.micro_step()
            lines = [int(s.train_set.lines[i]) for i in ids[index * micro:(index + 1) * micro]] if s.poisoned else []
            loss_sum += micro_step(s.model, batch, s.precision, s.device, step_tokens,
                                   faults.loss_factor(lines, s.poisoned))
    except ReleaseRequested:
        # Forget this step's partial work as if it never began, so the checkpoint (written by
        # train()) equals the state at the step boundary and resuming stays exact.
        s.optimizer.zero_grad(set_to_none=True)
        restore_rng(*rng_at_step_start)
        raise
    s.control.in_step = False
    return loss_sum, computed, padded


def _train_steps(s: "Session") -> str:
    cfg, p, guard, sync, rec, ckpt = s.job.training, s.progress, s.guard, s.sync, s.recorder, s.checkpointer
    micro, accum = cfg.batch_size, cfg.grad_accum
    per_step = micro * accum * sync.world_size  # examples drawn from the sampler per optimizer step, all ranks
    params = [q for q in s.model.parameters() if q.requires_grad]
    max_norm = cfg.max_grad_norm or math.inf  # 0 disables clipping; the norm is still measured
    s.model.train()
    if sync.start(s.model):
        return "interrupted"
    if eval_due(s, p.step) and not rec.has_eval_at(p.step):
        # The first eval, or one that a release abandoned (the checkpoint it left has no result for it).
        rec.eval(p.step, evaluate(s, p.step))
        if p.step == s.total_steps and rec.has_eval_at(p.step) and sync.saves_alone:
            ckpt.save()  # the last checkpoint carries the final eval, as in an uninterrupted run
    last_save = time.monotonic()
    while p.step < s.total_steps:
        started, held_before = time.perf_counter(), s.control.held_seconds
        p.position = guard.next_position(p.position, per_step)
        lr = lr_at(p.step, s.total_steps, cfg) * guard.state.lr_scale
        for group in s.optimizer.param_groups:
            group["lr"] = lr
        step_ids = [s.sampler.at(p.position + k) for k in range(per_step)]
        step_tokens = s.train_set.target_tokens(step_ids)  # of the whole step, every rank's examples
        loss_sum, computed, padded = _backward(s, step_ids[sync.rank::sync.world_size], step_tokens, micro, accum)
        loss_sum = sync.finish_step(params, loss_sum, last_save)
        loss_value, norm_value, finite, overflow = optimizer_step(params, s.optimizer, s.precision, max_norm, loss_sum)
        verdict, zscore = guard.after_step(p.step + 1, p.position, loss_value, finite)
        p.step += 1
        p.position += per_step
        p.tokens += step_tokens
        held = s.control.held_seconds - held_before  # the owner's time, not the step's: reported apart
        rec.step(loss=loss_value, grad_norm=norm_value, lr=lr, tokens=step_tokens,
                 seconds=time.perf_counter() - started - held, held=held, skipped=not finite or overflow,
                 samples=None if finite else [int(s.train_set.lines[i]) for i in step_ids],
                 computed=computed, padded=padded)
        if verdict == "spike":
            rec.spike(p.step, loss_value, zscore)
        if verdict == "rollback":
            ckpt.rollback(guard)
            last_save = time.monotonic()
            continue
        if cfg.eval_every and p.step % cfg.eval_every == 0 and p.step < s.total_steps:
            rec.eval(p.step, evaluate(s, p.step))
        every = s.job.checkpoints.every_steps
        due = (every and p.step % every == 0) or sync.save_due(last_save)
        if p.step == s.total_steps:
            rec.eval(p.step, evaluate(s, p.step))
        if guard.state.bad_in_row:
            due = False  # never commit a state in the middle of a run of bad steps
        stopping, release = sync.stopping(), sync.releasing()
        if due or stopping or release or p.step == s.total_steps:
            ckpt.save()
            last_save = time.monotonic()
        if release and p.step < s.total_steps:
            return "paused"
        if stopping and p.step < s.total_steps:
            return "interrupted"
    return "finished"
