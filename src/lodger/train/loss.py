"""The step's loss without whole logits: only positions with a label go through the head, a chunk
at a time, and the head's gradient is taken in the same pass.

A causal LM's last matmul (hidden -> vocabulary) makes the largest tensors of a step: the logits,
their log-softmax and, in the backward pass, their gradient, three times batch x length x
vocabulary floats (300 MB for SmolLM2 at 4 x 128). Chat fine-tuning labels only the replies, so
most positions' logits are never used. ``head_loss_sum`` selects the labelled positions, and for
each chunk of them computes the logits, the summed cross entropy, and at once the gradient that
flows back into the hidden states (and into the head's weight when it trains), then frees the
chunk. The backward pass only scales what was kept (hidden-sized). Same loss up to the float
summation order; fewer FLOPs (the head runs on target positions only) and a peak that no longer
grows with the vocabulary. Deterministic: fixed chunks in a fixed order, no atomics.

Used where the model's forward is exactly ``head(decoder(...))`` (``head_parts``: transformers
models of the types in HEAD_ONLY, a plain bias-free Linear head, e.g. not a LoRA-wrapped one) and
no autocast is active (mixed precision keeps transformers' own path, whose casts it would have to
copy); everything else computes whole logits as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# Model types whose causal-LM forward is `logits = lm_head(hidden_states)`, nothing after it (no
# soft-capping, scaling or bias): transformers' modeling_<type>.py.
HEAD_ONLY = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# Logit bytes of one chunk (fp32; a chunk costs about twice this at its peak: the logits, then
# their log-softmax, whose exponent is made in place). At least glibc's largest mmap threshold
# (32 MiB on 64-bit), so every chunk is a mapping of its own, returned to the system when freed:
# smaller blocks would raise the threshold and stay in the heap, and the resident set would wander.
CHUNK_BYTES = 32 * 2**20


def head_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(decoder, head) when ``model``'s logits are exactly ``head(decoder(...).last_hidden_state)``;
    None otherwise. Cached on the model (its structure does not change during a run)."""
    cached: tuple[torch.nn.Module, torch.nn.Linear] | None | bool = getattr(model, "_lodger_head_parts", False)
    if cached is not False and not isinstance(cached, bool):
        return cached
    if cached is None:
        return None
    parts: tuple[torch.nn.Module, torch.nn.Linear] | None = None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft
    config = getattr(base, "config", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    decoder = getattr(base, "base_model", None)  # transformers: the model without its head
    if (getattr(config, "model_type", None) in HEAD_ONLY and type(head) is torch.nn.Linear
            and head is not None and head.bias is None and decoder is not None and decoder is not base):
        parts = (decoder, head)
    model._lodger_head_parts = parts
    return parts


def head_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy of ``hidden @ weight.T`` against ``labels`` (-100: no label), as one
    autograd node whose backward returns the gradients it computed on the way (module docstring)."""
    flat = hidden.reshape(-1, hidden.size(-1))
    # Under no_grad (evals) autograd still reports the weight as needing a gradient; say it here.
    return _HeadLoss.apply(flat, weight, labels.reshape(-1), torch.is_grad_enabled())


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                grad_enabled: bool) -> torch.Tensor:
        rows = (labels != -100).nonzero().squeeze(1)
        chunk = -(-CHUNK_BYTES // (4 * weight.size(0)))  # rows, rounded up (the comment at CHUNK_BYTES)
        want_hidden = grad_enabled and ctx.needs_input_grad[0]
        want_weight = grad_enabled and ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, rows.numel(), chunk):
            at = rows[start:start + chunk]
            h, y = hidden.index_select(0, at), labels.index_select(0, at)
            logp = torch.log_softmax(F.linear(h, weight).float(), dim=-1)
            picked = logp.gather(1, y[:, None])
            total -= picked.sum()
            if grad_hidden is None and grad_weight is None:
                continue
            # d(-log p_y)/d logits = softmax - one_hot(y), made in the log-softmax's memory
            grad_logits = logp.exp_()
            grad_logits.scatter_(1, y[:, None], grad_logits.gather(1, y[:, None]) - 1.0)  # no atomics
            if grad_hidden is not None:
                grad_hidden[at] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += grad_logits.t() @ h.float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        return (None if grad_hidden is None else grad_hidden * grad_output.to(grad_hidden.dtype),
                None if grad_weight is None else (grad_weight * grad_output).to(ctx.weight_dtype),
                None, None)


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) of each row of ``hidden`` ([P, hidden]: labelled positions only) under the head
    ``weight``, the logits a chunk at a time and never whole: what a preference loss sums per
    sequence. Unlike ``head_loss_sum`` the gradient is not known in the forward pass (it depends on
    every token of a sequence through the loss), so the backward pass computes each chunk's logits
    again: the head's matmul once more, against whole logits' memory."""
    return _HeadLogprobs.apply(hidden, weight, labels)


def _chunk_rows(weight: torch.Tensor) -> int:
    return -(-CHUNK_BYTES // (4 * weight.size(0)))


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = torch.empty(hidden.size(0), dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        chunk = _chunk_rows(weight)
        for start in range(0, hidden.size(0), chunk):
            logits = F.linear(hidden[start:start + chunk], weight).float()
            lse[start:start + chunk] = torch.logsumexp(logits, dim=-1)
            out[start:start + chunk] = logits.gather(1, labels[start:start + chunk, None])[:, 0] - lse[start:start + chunk]
        ctx.save_for_backward(hidden, weight, labels, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        chunk = _chunk_rows(weight)
        for start in range(0, hidden.size(0), chunk):
            h, y, g = hidden[start:start + chunk], labels[start:start + chunk], grad_out[start:start + chunk]
            # d log p_y / d logits = one_hot(y) - softmax, scaled by each row's incoming gradient
            grad_logits = (F.linear(h, weight).float() - lse[start:start + chunk, None]).exp_().mul_(-g[:, None])
            grad_logits.scatter_(1, y[:, None], grad_logits.gather(1, y[:, None]) + g[:, None])  # no atomics
            if grad_hidden is not None:
                grad_hidden[start:start + chunk] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += grad_logits.t() @ h.float()
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None
