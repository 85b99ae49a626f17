"""Attention for packed rows on the CPU: each example attends within itself, one kernel call per
example, so a row of several examples costs the attention of those examples alone.

Why: transformers keeps packed examples apart (restarting ``position_ids``, no attention mask) by
building a block-diagonal mask over the whole row, and the CPU's dense sdpa then computes every
block of the row's T x T scores, the masked ones included: a row of four 200-token chats pays four
times the attention of the four chats (docs/packing.md measured packed rows losing to the Trainer's
length-grouped padded batches for that reason). Flash attention's varlen kernels do this split on a
GPU; this is the same idea for the CPU, with PyTorch's own ``scaled_dot_product_attention`` on each
example's slice (causal, no mask). Registered with transformers' ``AttentionInterface`` under
``SEGMENTS``; a key with no mask function of its own makes transformers build no mask at all.

Exact: a slice's causal attention is the block the mask kept, so the outputs are those of each
example run alone up to the kernels' float summation order (tests/unit/test_packing.py). Anything
that is not a packed training batch (a mask given, no position ids, a one-token query) goes to
transformers' own sdpa unchanged. Right-padded rows without their mask (evals of a run that packs)
are exact too: causal attention never lets a real token see the padding after it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SEGMENTS = "lodger_segments"


_LAST: list = [None, None]  # (position_ids, bounds): every layer of one forward gets the same tensor


def bounds_of(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """``segment_bounds``, worked out once per forward: the model hands each layer the same tensor."""
    if _LAST[0] is not position_ids:
        _LAST[:] = [position_ids, segment_bounds(position_ids)]
    return _LAST[1]


def segment_bounds(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the [start, end) of each example: a new one wherever the position does not step by one
    (transformers' ``find_packed_sequence_indices`` rule). One small host copy per call (CPU tensors)."""
    width = position_ids.shape[-1]
    new = torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1]) != 1
    new[:, 0] = True  # every row starts an example
    bounds = []
    for row in new:
        starts = row.nonzero().flatten().tolist()
        bounds.append(list(zip(starts, starts[1:] + [width])))
    return bounds


def segment_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      position_ids: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: (batch, heads, T, dim) in, (batch, T, heads, dim) out."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if attention_mask is not None or position_ids is None or query.shape[2] == 1 or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    rows = []
    rows_bounds = bounds_of(position_ids)
    if len(rows_bounds) != query.shape[0]:  # position ids given once for the whole batch
        rows_bounds = rows_bounds * query.shape[0]
    for b, bounds in enumerate(rows_bounds):
        parts = [F.scaled_dot_product_attention(query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e],
                                                dropout_p=dropout, scale=scaling, is_causal=e - s > 1)
                 for s, e in bounds]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None


def set_attention(model: torch.nn.Module, name: str = SEGMENTS) -> bool:
    """Switch a transformers model (under peft too) to attention ``name`` (``SEGMENTS``: registered
    here first); False when the model does not take it (it keeps its own)."""
    from transformers import AttentionInterface

    if name == SEGMENTS:
        AttentionInterface.register(SEGMENTS, segment_attention)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        base.set_attn_implementation(name)  # a model that cannot switch warns and keeps its own
    except (AttributeError, ValueError):
        return False
    return getattr(base.config, "_attn_implementation", None) == name
