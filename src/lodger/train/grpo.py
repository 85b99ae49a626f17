"""GRPO as an objective of the one training loop (objective.py's interface, plus ``prepare``):
each step's micro-batches of prompts become sampled, scored completions (rollout.py), whose
clipped policy loss the loop then takes as it takes any loss.

The loss follows TRL 1.16's ``GRPOTrainer._compute_loss`` (tests/unit/test_grpo_trl.py): per token,
ratio = exp(logp - old logp) (old = logp detached when each batch is trained once), clipped to
[1 - epsilon, 1 + epsilon_high], -min(ratio x A, clipped x A), plus beta x (exp(ref - logp) -
(ref - logp) - 1) with a reference; then ``dapo``: summed over the step's completion tokens and
divided by their number (every rank's); ``grpo``: each completion's mean, summed and divided by the
step's completions; ``dr_grpo``: summed and divided by completions x max_completion_length. So a
step's loss and gradient are the step's however it is cut into micro-batches and ranks (TRL's
equal micro-batches give the same numbers). Log-probabilities are taken at the sampling
temperature, as TRL does.

With num_iterations (mu) > 1 the completions of a step that is a multiple of mu are kept, with
their log-probabilities at sampling time, for the next mu - 1 steps (``Kept``, in every checkpoint
taken between: holders.Rollouts). Evals sample one greedy completion per held-out prompt (no
randomness drawn) and report the rewards; the eval loss is minus the mean total reward, so lower
is better there too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .loss import head_logprobs, head_parts
from .rollout import Rollout, Sampling, advantages, layout, reward_inputs, sample, text_preview

if TYPE_CHECKING:
    from ..config import GRPOConfig
    from ..data.packing import StepPlan
    from ..data.prompts import PromptSet
    from ..rewards import Rewards
    from .precision import Precision


def token_logps(model: torch.nn.Module, tensors: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """[rows, width]: at position j, log p(token j + 1) at ``temperature`` where ``mask`` is set, 0
    elsewhere. Only those positions go through the head (loss.head_logprobs) where the model allows
    it (loss.head_parts, no autocast); otherwise whole logits."""
    ids, mask = tensors["input_ids"], tensors["mask"]
    labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=0)
    keep = mask > 0
    inputs = {"input_ids": ids, "attention_mask": tensors["attention_mask"]}
    parts = head_parts(model)
    if parts is not None and not torch.is_autocast_enabled(ids.device.type):
        decoder, head = parts
        hidden = decoder(**inputs, use_cache=False).last_hidden_state
        picked = head_logprobs(hidden[keep] / temperature, head.weight, labels[keep])
    else:
        logits = model(**inputs, use_cache=False).logits[keep].float() / temperature
        picked = logits.gather(1, labels[keep][:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    out[keep] = picked.float()
    return out


@dataclass
class Kept:
    """Completions kept for the next passes (mu > 1): sampled at step ``step`` for the step planned
    at sampler position ``position``."""

    step: int
    position: int
    rollouts: list[Rollout]


class RepeatPlanner:
    """mu > 1: the steps after a sampling step train on its kept completions, so their plan is that
    step's (the sampler position does not move until the next sampling). Everything else is the
    planner's it wraps."""

    def __init__(self, inner: Any, objective: "GRPO", progress: Any):
        self.inner, self.objective, self.progress = inner, objective, progress

    def plan(self, position: int) -> StepPlan:
        kept = self.objective.live_kept(self.progress.step)
        return self.inner.plan(kept.position if kept is not None else position)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class GRPO:
    """The objective (module docstring). Built by the Session with what sampling and scoring need."""

    name, sequences = "grpo", 1

    def __init__(self, grpo: GRPOConfig, rewards: Rewards, *, tokenizer: Any, dataset: Any, eval_set: Any,
                 precision: Precision, device: str, sync: Any, progress: Any, reference: Any = None):
        # dataset, eval_set: PromptSets (data/prompts.py), held by the Session as its train and eval sets
        self.cfg, self.rewards, self.tokenizer = grpo, rewards, tokenizer
        self.dataset, self.eval_set = dataset, eval_set
        self.precision, self.device, self.sync, self.reference = precision, device, sync, reference
        self.progress = progress  # an eval's rewards are told the step it follows
        self.epsilon_low, self.epsilon_high = grpo.epsilon, grpo.epsilon_high or grpo.epsilon
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.ends: frozenset[int] = frozenset(e for e in (tokenizer.eos_token_id,) if e is not None)
        self.sampling = Sampling(grpo.max_completion_length, self.ends, temperature=grpo.temperature,
                                 top_k=grpo.top_k, top_p=grpo.top_p)
        self.greedy = Sampling(grpo.max_completion_length, self.ends, greedy=True)
        self.kept: Kept | None = None
        self.totals: tuple[float, ...] = (1.0,)
        self.samples: list[dict] = []
        self.evaluating = False

    # -- the step's data -------------------------------------------------------------------------

    def prepare(self, model: torch.nn.Module, batches: list[Any], step: int | None, position: int | None) -> list[Rollout]:
        """The step's rollouts: sampled and scored now, or (mu > 1, a step that is not a multiple
        of mu) the kept ones; ``step`` None: an eval's greedy completions. ``position``: where the
        step's plan starts (kept with the rollouts)."""
        self.evaluating = step is None
        if step is None:
            return [self._rollout(model, batch.prompt_indices, None) for batch in batches]
        kept = self.live_kept(step)
        if kept is not None:
            rollouts = kept.rollouts
        else:
            rollouts = [self._rollout(model, batch.prompt_indices, step) for batch in batches]
            if self.cfg.num_iterations > 1:
                # Kept from now on: a release before the step ends leaves a checkpoint at this step,
                # a multiple of mu, which holds no kept rollouts; the resumed step samples again.
                self.kept = Kept(step, int(position or 0), rollouts)
        rows = sum(r.rows for r in rollouts)
        tokens = sum(r.target_tokens for r in rollouts)
        self.totals = tuple(self.sync.sum_across([float(rows), float(tokens)]))  # every rank's
        return rollouts

    def live_kept(self, step: int) -> Kept | None:
        """The kept rollouts step ``step`` trains on (mu > 1, not a multiple of mu), or None: sample."""
        mu = self.cfg.num_iterations
        if mu > 1 and step % mu and self.kept is not None and self.kept.step == step - step % mu:
            return self.kept
        return None

    def _rollout(self, model: torch.nn.Module, indices: list[int], step: int | None) -> Rollout:
        greedy = step is None
        dataset = self.eval_set if greedy else self.dataset
        group = 1 if greedy else self.cfg.num_generations
        rows = [i for i in indices for _ in range(group)]
        prompts = [dataset.prompt_ids(i) for i in rows]
        completions = sample(model, prompts, sampling=self.greedy if greedy else self.sampling, pad_id=self.pad_id,
                             precision=self.precision, device=self.device)
        tensors = layout(prompts, completions, self.pad_id, self.cfg.mask_truncated_completions,
                         self.cfg.max_completion_length, self.ends)
        given = reward_inputs(dataset, rows, completions, self.tokenizer)
        scored = self.rewards.score(given["prompts"], given["completions"], given["completion_ids"], given["fields"],
                                    given["lines"], self.progress.step if step is None else step, evaluating=greedy)
        table = torch.tensor(scored, dtype=torch.float32)
        weights = torch.tensor(self.rewards.weights, dtype=torch.float32)
        total, advantage, zero_std = advantages(table, weights, group, self.cfg.scale_rewards == "group")
        tensors.update(rewards=table, total=total, advantages=advantage, zero_std=zero_std.view(-1, group)[:, 0])
        rollout = Rollout(tensors, rows, len(indices), greedy, given["texts"])
        if not greedy:
            self._score_passes(model, rollout)
        else:
            self._keep_samples(dataset, rollout, given)
        return rollout

    @torch.no_grad()
    def _score_passes(self, model: torch.nn.Module, rollout: Rollout) -> None:
        """The log-probabilities the loss compares with: at sampling time (mu > 1) and under the
        reference (beta > 0); eval mode, so no randomness is drawn."""
        need_old, need_ref = self.cfg.num_iterations > 1, self.cfg.beta > 0
        if not (need_old or need_ref):
            return
        tensors = {k: v.to(self.device) for k, v in rollout.tensors.items() if k in ("input_ids", "attention_mask", "mask")}
        was_training = model.training
        model.eval()
        try:
            with self.precision.autocast():
                if need_old:
                    rollout.tensors["old_logps"] = token_logps(model, tensors, self.cfg.temperature).cpu()
                if need_ref:
                    rollout.tensors["ref_logps"] = self._reference_logps(model, tensors).cpu()
        finally:
            model.train(was_training)

    def _reference_logps(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.reference is not None:  # full fine-tuning: the frozen copy of the base
            return token_logps(self.reference, tensors, self.cfg.temperature)
        with model.disable_adapter():  # LoRA: the base is the model without its adapter, no copy
            return token_logps(model, tensors, self.cfg.temperature)

    def _keep_samples(self, dataset: PromptSet, rollout: Rollout, given: dict) -> None:
        room = self.cfg.eval_samples - len(self.samples)
        for r in range(min(room, rollout.rows)):
            values = rollout.tensors["rewards"][r].tolist()
            total = float(rollout.tensors["total"][r])
            self.samples.append({
                "line": given["lines"][r], "prompt": text_preview(given["prompts"][r], 600),
                "completion": text_preview(given["texts"][r], 2000),
                "rewards": {label: (None if math.isnan(v) else v) for label, v in zip(self.rewards.labels, values)},
                "reward": None if math.isnan(total) else total})

    # -- the loss (objective.py's interface) -----------------------------------------------------

    def weights(self, dataset: PromptSet, indices: list[int]) -> tuple[float, ...]:
        """The last prepared step's normaliser (every rank's completions or tokens); an eval's prompts."""
        if self.evaluating:
            return (float(len(indices)),)
        rows, tokens = self.totals
        if self.cfg.loss_type == "dapo":
            return (max(tokens, 1.0),)
        if self.cfg.loss_type == "dr_grpo":
            return (rows * self.cfg.max_completion_length,)
        return (rows,)

    def target_tokens(self, dataset: PromptSet, indices: list[int]) -> int:
        """The step's completion tokens that count in the loss (every rank's)."""
        return 0 if self.evaluating else int(self.totals[1])

    def terms(self, model: torch.nn.Module, batch: Rollout, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        tensors = {k: v.to(device) for k, v in batch.tensors.items()}
        if batch.greedy:  # an eval: minus the total reward, and the reward sums
            return -torch.nan_to_num(tensors["total"], nan=0.0).sum(), self._reward_sums(tensors, None)
        mask = tensors["mask"]
        logps = token_logps(model, tensors, self.cfg.temperature)
        old = tensors.get("old_logps", logps.detach())
        ratio = torch.exp(logps - old)
        clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        advantage = tensors["advantages"].unsqueeze(1)
        per_token = -torch.min(ratio * advantage, clipped * advantage)
        kl = None
        if self.cfg.beta > 0:
            ref = tensors["ref_logps"]
            kl = torch.exp(ref - logps) - (ref - logps) - 1
            per_token = per_token + self.cfg.beta * kl
        if self.cfg.loss_type == "grpo":
            loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
        else:
            loss = (per_token * mask).sum()
        with torch.no_grad():
            low = ((ratio < 1 - self.epsilon_low) & (advantage < 0)).float() * mask
            high = ((ratio > 1 + self.epsilon_high) & (advantage > 0)).float() * mask
            tokens = [(kl * mask).sum() if kl is not None else mask.new_zeros(()), low.sum(), high.sum(),
                      (low + high).sum(), mask.sum()]
        return loss, self._reward_sums(tensors, torch.stack(tokens))

    def _reward_sums(self, tensors: dict[str, torch.Tensor], tokens: torch.Tensor | None) -> torch.Tensor:
        """The metric sums: per function and in total (sum, sum of squares, count), groups with all
        rewards equal, lengths, truncations; then (training) KL and clipping over tokens."""
        table, total = tensors["rewards"], tensors["total"]
        parts = []
        for column in [table[:, f] for f in range(table.shape[1])] + [total]:
            seen = ~torch.isnan(column)
            values = torch.where(seen, column, torch.zeros_like(column)).double()
            parts += [values.sum(), (values * values).sum(), seen.float().sum()]
        zero = tensors["zero_std"].float()  # one flag per prompt's group
        parts += [zero.sum(), torch.tensor(float(zero.numel())), tensors["lengths"].sum(),
                  torch.tensor(float(tensors["lengths"].numel())), tensors["truncated"].float().sum()]
        sums = torch.stack([p.double().to(total.device) for p in parts])
        if tokens is not None:
            sums = torch.cat([sums, tokens.double()])
        return sums

    def combine(self, terms: torch.Tensor, weights: tuple[float, ...]) -> torch.Tensor:
        return terms / weights[0]

    def metrics(self, sums: torch.Tensor, weights: tuple[float, ...]) -> dict[str, Any]:
        values = sums.tolist()
        out: dict[str, Any] = {}
        labels = self.rewards.labels
        for k, label in enumerate(labels + ["total"]):
            total, squares, count = values[3 * k:3 * k + 3]
            mean = total / count if count else None
            std = math.sqrt(max(squares - total * total / count, 0.0) / (count - 1)) if count > 1 else None
            key = "reward" if label == "total" else f"reward_{label}"
            out[key] = mean
            out[f"{key}_std"] = std
        at = 3 * (len(labels) + 1)
        zero, groups, length, completions, truncated = values[at:at + 5]
        out["frac_reward_zero_std"] = zero / groups if groups else None
        out["completion_length"] = length / completions if completions else None
        out["truncated_ratio"] = truncated / completions if completions else None
        if len(values) > at + 5:  # training: over the completion tokens
            kl, low, high, region, tokens = values[at + 5:at + 10]
            if self.cfg.beta > 0:
                out["kl"] = kl / tokens if tokens else None
            out.update(clip_ratio_low=low / tokens if tokens else 0.0, clip_ratio_high=high / tokens if tokens else 0.0,
                       clip_ratio=region / tokens if tokens else 0.0)
        if self.evaluating and self.samples:
            out["samples"], self.samples = self.samples, []
        return {k: v for k, v in out.items() if v is not None}
