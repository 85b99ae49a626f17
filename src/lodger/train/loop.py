"""The training loop: one function, read top to bottom.

Per optimizer step: learning rate, the step's micro-batches from the sampler, forward and
backward with the loss normalised over the whole step's target tokens, clip, finite check,
update, log, eval when due, checkpoint when due or when asked to stop.

With several ranks (``world_size > 1``, see distributed.py) each rank takes slots ``rank::world``
of the step's global example order, the loss is normalised over the whole step's target tokens
on every rank, and one all-reduce after the backward passes sums the gradients, the loss and
rank 0's control flags: every rank then clips and steps on identical numbers. Control requests
are answered at that one point per step, collectively, instead of at every micro-step.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..control import ReleaseRequested
from ..data import collate
from ..rng import capture as capture_rng
from ..rng import restore as restore_rng
from .optim import lr_at

if TYPE_CHECKING:
    from ..session import Session


def token_loss_sum(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token cross entropy over positions with a label, and how many there were.

    The labels move left instead of the logits (the last position predicts nothing): slicing the
    logits would copy them, the largest tensor of the step (batch x length x vocabulary)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                           ignore_index=-100, reduction="sum")
    return loss, int((labels != -100).sum())


def install_yield_points(model: torch.nn.Module, control) -> int:
    """Let hold and release requests in at every transformer layer, forward and backward.

    A forward pre-hook checks before each layer runs; a hook on the layer's output tensor checks
    when autograd reaches that layer on the way back (on CPU autograd runs those hooks in this
    thread, so a SIGUSR1 that arrived mid-step is seen there too). Both cost one attribute read
    while nothing is asked. Installed once per model (a rollback re-enters the loop); returns
    the number of layers hooked."""
    if getattr(model, "_lodger_yield_points", None) is control:
        return 0
    model._lodger_yield_points = control
    layers = [m for name, m in model.named_modules()
              if isinstance(m, torch.nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks")]
    hooked = 0
    for layer_list in layers:
        for layer in layer_list:
            layer.register_forward_pre_hook(lambda module, args: control.yield_point())
            layer.register_forward_hook(lambda module, args, output: _hook_backward(output, control))
            hooked += 1
    return hooked


def _hook_backward(output, control) -> None:
    tensor = output[0] if isinstance(output, (tuple, list)) else output
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
        tensor.register_hook(control.yield_point)  # returns None: the gradient is left as it is


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
    s.reporter.eval_started(step, len(s.eval_indices), len(starts))
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
    s.eval_seconds = time.perf_counter() - began - (s.control.held_seconds - held_before)
    return total / max(count, 1)


def train(s: "Session") -> str:
    """Run from ``s.progress`` to the last step; return "finished", "interrupted" or "paused"."""
    try:
        return _train_steps(s)
    except ReleaseRequested:
        # Give the machine back now, with the state of the last finished step (a partial step has
        # been undone below; an abandoned eval changed nothing and is run again on resume).
        s.control.in_step = False
        s.save_checkpoint(skip_if_exists=True)
        return "paused"


def _train_steps(s: "Session") -> str:
    cfg, p, guard, precision = s.job.training, s.progress, s.guard, s.precision
    micro, accum = cfg.batch_size, cfg.grad_accum
    world, rank = s.world_size, s.rank
    per_step = micro * accum * world  # examples drawn from the sampler per optimizer step, all ranks
    params = [q for q in s.model.parameters() if q.requires_grad]
    max_norm = cfg.max_grad_norm or math.inf  # 0 disables clipping; the norm is still measured
    s.model.train()
    if world == 1:  # several ranks answer requests together, once per step (Session.sync_step)
        install_yield_points(s.model, s.control)
        if s.control.stop:
            return "interrupted"  # Ctrl-C or SIGTERM while starting: nothing trained, nothing to commit
    if eval_due(s, p.step) and not s.has_eval_at(p.step):
        # The first eval, or one that a release abandoned (the checkpoint it left has no result for it).
        s.record_eval(p.step, evaluate(s, p.step))
        if p.step == s.total_steps and s.has_eval_at(p.step) and world == 1:  # (ranks never abandon an eval)
            s.save_checkpoint()  # the last checkpoint carries the final eval, as in an uninterrupted run
    last_save = time.monotonic()
    while p.step < s.total_steps:
        started, held_before = time.perf_counter(), s.control.held_seconds
        p.position = guard.next_position(p.position, per_step)
        lr = lr_at(p.step, s.total_steps, cfg) * guard.state.lr_scale
        for group in s.optimizer.param_groups:
            group["lr"] = lr
        step_ids = [s.sampler.at(p.position + k) for k in range(per_step)]
        ids = step_ids[rank::world]  # this rank's share; all of them when world == 1
        batches = [collate(s.train_set, ids[i * micro:(i + 1) * micro], s.pad_id) for i in range(accum)]
        step_tokens = s.train_set.target_tokens(step_ids)  # of the whole step, every rank's examples
        loss_sum = torch.zeros((), dtype=torch.float32, device=s.device)
        rng_at_step_start = capture_rng()  # a few KB copied; lets a release drop this step exactly
        try:
            s.control.in_step = True  # a release now drops this step
            for index, batch in enumerate(batches):
                if world == 1:  # with several ranks, control is answered collectively below
                    s.check_limits()
                    s.control.checkpoint_boundary()  # microseconds; where hold and release are answered
                with precision.autocast():
                    loss, _ = token_loss_sum(s.model, {k: v.to(s.device) for k, v in batch.items()})
                loss = loss / step_tokens
                if s.poison_lines:  # test-only fault injection ($LODGER_TEST_POISON_LINES)
                    loss = loss * s.poison_factor(ids[index * micro:(index + 1) * micro])
                precision.backward(loss)
                loss_sum += loss.detach()
        except ReleaseRequested:
            # Forget this step's partial work as if it never began, so the checkpoint (written by
            # train()) equals the state at the step boundary and resuming stays exact.
            s.optimizer.zero_grad(set_to_none=True)
            restore_rng(*rng_at_step_start)
            raise
        s.control.in_step = False
        release = stop = time_due = False
        if world > 1:
            # Ranks act only on what rank 0 said here: a signal arriving later waits for the next step,
            # or one rank would checkpoint alone.
            loss_sum, (release, stop, time_due) = s.sync_step(params, loss_sum, last_save)
        precision.unscale(s.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        loss_value, norm_value = loss_sum.item(), grad_norm.item()  # one device sync per step
        overflow = precision.scaler is not None and math.isfinite(loss_value) and not math.isfinite(norm_value)
        finite = (math.isfinite(loss_value) and math.isfinite(norm_value)) or overflow
        if finite:
            precision.step(s.optimizer)  # with fp16 loss scaling an overflow skips inside and lowers the scale
        else:
            precision.skip()
        s.optimizer.zero_grad(set_to_none=True)
        verdict, zscore = guard.after_step(p.step + 1, p.position, loss_value, finite)
        p.step += 1
        p.position += per_step
        p.tokens += step_tokens
        held = s.control.held_seconds - held_before  # the owner's time, not the step's: reported apart
        s.record_step(loss=loss_value, grad_norm=norm_value, lr=lr, tokens=step_tokens,
                      seconds=time.perf_counter() - started - held, held=held, skipped=not finite or overflow,
                      samples=None if finite else [int(s.train_set.lines[i]) for i in step_ids])
        if verdict == "spike" and rank == 0:
            s.ledger.event(s.run_id, "loss_spike", step=p.step, loss=loss_value, zscore=round(zscore, 2))
        if verdict == "rollback":
            s.rollback()
            last_save = time.monotonic()
            continue
        if cfg.eval_every and p.step % cfg.eval_every == 0 and p.step < s.total_steps:
            s.record_eval(p.step, evaluate(s, p.step))
        ck = s.job.checkpoints
        due = (ck.every_steps and p.step % ck.every_steps == 0) or (
            ck.every_seconds is not None and time.monotonic() - last_save >= ck.every_seconds)
        if world > 1:  # rank 0's clock decides, or the ranks would disagree about saving
            due = (ck.every_steps and p.step % ck.every_steps == 0) or time_due
        if p.step == s.total_steps:
            s.record_eval(p.step, evaluate(s, p.step))
        if guard.state.bad_in_row:
            due = False  # never commit a state in the middle of a run of bad steps
        stopping = bool(s.control.stop) if world == 1 else stop
        if due or stopping or release or p.step == s.total_steps:
            s.save_checkpoint()
            last_save = time.monotonic()
        if release and p.step < s.total_steps:
            return "paused"
        if stopping and p.step < s.total_steps:
            return "interrupted"
    return "finished"
