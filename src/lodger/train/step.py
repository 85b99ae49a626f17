"""One training step's pieces, shared by the loop and the memory estimator (which measures by
calling them): the loss, a micro-step (forward and backward), the optimizer update, and the yield
points that let hold and release in during a step."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .loss import head_loss_sum, head_parts

if TYPE_CHECKING:
    from ..owner.control import Control
    from .collaborators import Objective
    from .precision import Precision


def token_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token cross entropy over positions with a label, and how many there were.

    The labels move left instead of the logits (the last position predicts nothing): slicing the
    logits would copy them, the largest tensor of the step (batch x length x vocabulary). Where
    the model's head allows (loss.py), the logits are never made whole: only positions with a
    label go through the head, a chunk at a time."""
    # A packed batch (data/packing.py) has position_ids and no attention_mask; without a KV cache
    # transformers reads the example boundaries from the restarting position ids.
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    labels = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    parts = head_parts(model)
    if parts is not None and not torch.is_autocast_enabled(labels.device.type):
        decoder, head = parts
        hidden = decoder(**inputs, use_cache=False).last_hidden_state
        return head_loss_sum(hidden, head.weight, labels), int((labels != -100).sum())
    logits = model(**inputs, use_cache=False).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                           ignore_index=-100, reduction="sum")
    return loss, int((labels != -100).sum())


def install_yield_points(model: torch.nn.Module, control: Control) -> int:
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


def _hook_backward(output: Any, control: Control) -> None:
    tensor = output[0] if isinstance(output, (tuple, list)) else output
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
        tensor.register_hook(control.yield_point)  # returns None: the gradient is left as it is


def micro_step(objective: Objective, model: torch.nn.Module, batch: Any, precision: Precision, device: str,
               weights: tuple[float, ...],
               factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward and backward of one micro-batch: the objective's loss terms (objective.py), combined
    with the whole step's normalisers ``weights`` (``factor``: test-only fault injection, see
    faults.py); returns the detached loss and the batch's metric sums (None for SFT)."""
    with precision.autocast():
        terms, sums = objective.terms(model, batch, device)
    loss = objective.combine(terms, weights)
    if factor != 1.0:
        loss = loss * factor
    precision.backward(loss)
    return loss.detach(), sums


def optimizer_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, precision: Precision,
                   max_norm: float, loss_sum: torch.Tensor) -> tuple[float, float, bool, bool]:
    """Clip, check finite, update (or skip); return (loss, grad norm, finite, fp16 overflow)."""
    precision.unscale(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    loss_value, norm_value = loss_sum.item(), grad_norm.item()  # one device sync per step
    overflow = precision.scaler is not None and math.isfinite(loss_value) and not math.isfinite(norm_value)
    finite = (math.isfinite(loss_value) and math.isfinite(norm_value)) or overflow
    if finite:
        precision.step(optimizer)  # with fp16 loss scaling an overflow skips inside and lowers the scale
    else:
        precision.skip()
    optimizer.zero_grad(set_to_none=True)
    return loss_value, norm_value, finite, overflow
