"""GRPO's rollouts: for each prompt of a micro-batch, G completions sampled from the current policy
(batched, with a KV cache), scored by the reward functions, with
advantages normalised within each prompt's group, laid out for the loss.

Why these choices:
- Sampling runs in eval mode under no_grad: no dropout noise in the policy that samples, and no
  randomness drawn but the sampler's own (torch's global generator, whose state at the step's start
  every checkpoint holds: a resumed step samples the very same tokens).
- The decode loop is lodger's own over transformers' KV cache (``sample``: five times faster than
  ``generate`` here), with transformers' temperature, top-k and top-p rules.
- Prompts are left-padded for generation (transformers takes the position ids from the attention
  mask); the loss's batch is laid out right-padded, one completion a row (prompt, then completion),
  so every token sits at the position it had when it was sampled.
- The transformer layers' yield points (step.install_yield_points) fire at every decode step, so a
  hold, a release or `lodger serve`'s request takes effect between (and within) decode steps; a
  release drops the step's partial rollout with the rest of the step.
- Advantages follow TRL 1.16's `sum_then_normalize`: the weighted sum over functions (NaN where
  every function returned None), its group mean and (Bessel-corrected) standard deviation ignoring
  NaN, (reward - mean) / (std + 1e-4), NaN advantages set to 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..faults import fault_point
from ..rewards.builtin import text_of

if TYPE_CHECKING:
    from ..data.prompts import PromptSet
    from .precision import Precision


@dataclass
class Rollout:
    """One micro-batch of completions, ready for the loss: ``tensors`` has ``input_ids`` and
    ``attention_mask`` ([rows, width], right-padded), ``mask`` (1 where position j predicts a
    completion token that counts in the loss), ``advantages`` [rows], ``rewards`` [rows, functions]
    (NaN: does not apply), ``total`` [rows] (weighted, NaN: none applied), ``lengths`` and
    ``truncated`` [rows]; with mu > 1 ``old_logps``, with beta > 0 ``ref_logps`` ([rows, width]).
    ``prompts`` are the rows' dataset indices; ``texts`` the completions' text (for eval samples)."""

    tensors: dict[str, torch.Tensor]
    prompts: list[int]
    groups: int
    greedy: bool = False
    texts: list[str] = field(default_factory=list)

    @property
    def target_tokens(self) -> int:
        """Completion tokens that count in the loss."""
        return int(self.tensors["mask"].sum())

    @property
    def rows(self) -> int:
        return int(self.tensors["input_ids"].shape[0])

    # The step line's counts (packing.PackedBatch's): the loss forward's positions are left out on
    # purpose, so no padding share or MFU is shown: generation is most of a GRPO step and is not counted.
    tokens = target_tokens
    positions, attended = 0, 0


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn: greedy (evals), or at ``temperature`` among the ``top_k`` most
    likely tokens (0: all) within nucleus ``top_p``, as transformers' warpers do it (temperature,
    then top-k, then top-p, then one draw from the softmax); at most ``max_new`` tokens, each row
    ending at its first token of ``ends``."""

    max_new: int
    ends: frozenset[int]
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_new: int = 0  # the estimator's measurement samples every completion to its full length

    def pick(self, logits: torch.Tensor, made: int) -> torch.Tensor:
        """The next token of each row from its last logits (draws from torch's global generator)."""
        if made < self.min_new:
            logits[:, sorted(self.ends)] = -float("inf")
        if self.greedy:
            return logits.argmax(-1)
        if self.temperature != 1.0:
            logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -float("inf"))
        if self.top_p < 1.0:  # transformers' TopPLogitsWarper: ascending order, at least one token kept
            ordered, order = torch.sort(logits, descending=False)
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            remove = cumulative <= (1 - self.top_p)
            remove[:, -1] = False
            logits = logits.masked_fill(remove.scatter(1, order, remove), -float("inf"))
        return torch.multinomial(logits.softmax(dim=-1), num_samples=1)[:, 0]


@torch.no_grad()
def sample(model: torch.nn.Module, prompt_ids: list[list[int]], *, sampling: Sampling, pad_id: int,
           precision: Precision, device: str) -> list[list[int]]:
    """One completion for each prompt (the list already repeats each prompt G times): the token
    ids, through the first end token.

    A decode loop of its own over transformers' KV cache rather than ``generate``: on SmolLM2 with
    16 rows of 40 + 16 tokens on 2 threads, ``generate`` took 16-21 s where this loop took 3.2 s
    (its per-step bookkeeping, not the model, made the difference). Prompts are left-padded, with
    position ids counted from each row's first real token."""
    from transformers import DynamicCache

    width = max(map(len, prompt_ids))
    rows = len(prompt_ids)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for r, prompt in enumerate(prompt_ids):  # left padding: every row's next token at the same column
        ids[r, width - len(prompt):] = torch.tensor(prompt)
        attention[r, width - len(prompt):] = 1
    ids, attention = ids.to(device), attention.to(device)
    position = (attention.cumsum(-1) - 1).clamp(min=0)
    ends = torch.tensor(sorted(sampling.ends), device=device)
    was_training = model.training
    model.eval()
    made: list[torch.Tensor] = []
    try:
        with precision.autocast():
            out = model(input_ids=ids, attention_mask=attention, position_ids=position, use_cache=True,
                        cache=DynamicCache(), logits_to_keep=1)
            done = torch.zeros(rows, dtype=torch.bool, device=device)
            position = position[:, -1:] + 1
            for step in range(sampling.max_new):
                fault_point("decode_step")  # the test suite's fault point inside generation (faults.py)
                token = sampling.pick(out.logits[:, -1].float(), step)
                token = torch.where(done, torch.full_like(token, pad_id), token)
                made.append(token)
                done |= torch.isin(token, ends)
                if step + 1 == sampling.max_new or bool(done.all()):  # one device sync per decode step
                    break
                attention = torch.cat([attention, torch.ones((rows, 1), dtype=attention.dtype, device=device)], 1)
                out = model(input_ids=token[:, None], attention_mask=attention, position_ids=position, use_cache=True,
                            cache=out.cache)  # transformers 5's name (past_key_values is deprecated)
                position = position + 1
    finally:
        model.train(was_training)
    completions = []
    for row in torch.stack(made, 1).tolist():
        cut = next((k + 1 for k, token in enumerate(row) if token in sampling.ends), len(row))
        completions.append(row[:cut])
    return completions


def layout(prompt_ids: list[list[int]], completions: list[list[int]], pad_id: int, mask_truncated: bool,
           limit: int, ends: "set[int] | frozenset[int]") -> dict[str, torch.Tensor]:
    """The loss's batch: each row its prompt then its completion, right-padded; ``mask`` marks the
    positions whose next token is a completion token that counts; ``lengths``, ``truncated``."""
    width = max(len(p) + len(c) for p, c in zip(prompt_ids, completions))
    rows = len(completions)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.float32)
    truncated = torch.zeros(rows, dtype=torch.bool)
    for r, (prompt, completion) in enumerate(zip(prompt_ids, completions)):
        n, m = len(prompt), len(completion)
        input_ids[r, :n + m] = torch.tensor(prompt + completion, dtype=torch.long)
        attention[r, :n + m] = 1
        truncated[r] = m >= limit and (not completion or completion[-1] not in ends)
        if not (mask_truncated and truncated[r]):
            mask[r, n - 1:n + m - 1] = 1.0  # position j predicts token j + 1
    return {"input_ids": input_ids, "attention_mask": attention, "mask": mask,
            "lengths": torch.tensor([len(c) for c in completions], dtype=torch.float32), "truncated": truncated}


def nanstd(values: torch.Tensor, dim: int) -> torch.Tensor:
    """TRL's nanstd: the Bessel-corrected standard deviation ignoring NaN, in its order of operations
    (the correction rounded first: ``variance * count / (count - 1)`` differs in the last bit)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(values), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.nan)
    return torch.sqrt(variance * correction).squeeze(dim)


def advantages(table: torch.Tensor, weights: torch.Tensor, group: int, scale: bool) -> tuple[torch.Tensor, ...]:
    """(total reward per completion, advantage, whether its group's rewards are all equal) from the
    [completions, functions] table, in TRL 1.16's order of operations."""
    unscorable = torch.isnan(table).all(dim=1)
    total = (table * weights.unsqueeze(0)).nansum(dim=1)
    total[unscorable] = torch.nan
    grouped = total.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group, dim=0)
    std = nanstd(grouped, dim=1).repeat_interleave(group, dim=0)
    advantage = total - mean
    if scale:
        advantage = advantage / (std + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return total, torch.nan_to_num(advantage, nan=0.0), zero_std


def reward_inputs(dataset: PromptSet, indices: list[int], completions: list[list[int]],
                  tokenizer: Any) -> dict[str, Any]:
    """What a reward call gets, TRL's way: the prompts as written, the completions as text (or as
    an assistant message for conversational prompts), their ids, and every other field of the
    prompts' lines, one entry per completion; and the lines, for errors."""
    rows = [dataset.row(i) for i in indices]
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    shaped = [[{"role": "assistant", "content": t}] if isinstance(row["prompt"], list) else t
              for row, t in zip(rows, texts)]
    keys = sorted({k for row in rows for k in row if k not in ("prompt", "line")})
    return {"prompts": [row["prompt"] for row in rows], "completions": shaped, "completion_ids": completions,
            "fields": {k: [row.get(k) for row in rows] for k in keys}, "lines": [row["line"] for row in rows],
            "texts": texts}


def text_preview(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else "\n".join(f"{m.get('role')}: {m.get('content')}" for m in value)
    return text if len(text) <= limit else text[:limit] + " ..."


__all__ = ["Rollout", "Sampling", "sample", "layout", "advantages", "reward_inputs", "nanstd", "text_of", "text_preview"]
