"""AdamW, the warmup + cosine schedule, and their state as safetensors + JSON (no pickle)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load as load_tensors

from ..tensorfile import TensorFile

if TYPE_CHECKING:
    from ..config import TrainingConfig


def build_optimizer(params: list[torch.nn.Parameter], training: TrainingConfig) -> torch.optim.Optimizer:
    """AdamW; fused on CPU and GPU where torch has it (the Hugging Face Trainer's choice too)."""
    kwargs = dict(lr=training.learning_rate, weight_decay=training.weight_decay, betas=(0.9, 0.999), eps=1e-8)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, foreach=True, **kwargs)


def lr_at(step: int, total: int, training: TrainingConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine decay.

    A pure function of the step, so resuming needs no scheduler object to restore.
    """
    peak, warmup = training.learning_rate, training.warmup_steps
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = peak * training.min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def optimizer_files(optimizer: torch.optim.Optimizer) -> dict:
    """optimizer.safetensors (every state tensor, as a TensorFile streamed when written) and
    optimizer.json (structure and hyperparameters)."""
    state = optimizer.state_dict()
    tensors, plain = {}, {}
    for index, slots in state["state"].items():
        for key, value in slots.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = value.detach().contiguous()
            else:
                plain[f"{index}.{key}"] = value
    structure = {"param_groups": state["param_groups"], "plain": plain, "class": type(optimizer).__name__}
    return {"optimizer.safetensors": TensorFile(tensors),
            "optimizer.json": json.dumps(structure, sort_keys=True).encode()}


def load_optimizer(optimizer: torch.optim.Optimizer, files: Mapping[str, Any]) -> None:
    """Restore what ``optimizer_files`` wrote, bit for bit."""
    structure = json.loads(files["optimizer.json"])
    state: dict[int, dict] = {}
    for name, value in load_tensors(files["optimizer.safetensors"]).items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    for name, value in structure["plain"].items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": structure["param_groups"]})
