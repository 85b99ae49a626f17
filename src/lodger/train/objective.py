"""What a step's loss is: one object per [method] objective, behind the same small interface, so
the loop has no objective branches.

- ``weights(dataset, indices)``: the step's normalisers, from all of its examples (every rank's):
  SFT's target tokens; DPO's pairs; ORPO's pairs and chosen tokens; KTO's lines.
- ``terms(model, batch, device)``: one micro-batch's forward: its loss terms, each a sum over the
  batch (a tensor with gradient), and the detached sums its metrics are made from (None for SFT).
- ``combine(terms, weights)``: the loss from the terms and the step's normalisers, so a step's loss
  (and gradient) is that of the whole step however it is cut into micro-batches and ranks; evals
  combine the terms summed over the held-out set with its normalisers.
- ``metrics(sums, weights)``: the metric line's fields from the step's summed ``sums``
  (``step.micro_step`` runs a micro-batch's forward and backward through these).
- ``prepare(model, batches, step, position)``: what the step trains on, before ``weights``: the
  collated micro-batches as they are, or (GRPO, grpo.py) completions sampled and scored now;
  ``target_tokens(dataset, indices)``: the step's tokens that carry loss.

The preference losses follow TRL 1.16's (the anchor they are tested against,
tests/unit/test_preference_trl.py): DPO's sigmoid loss, ORPO's odds-ratio term on per-token mean
log-probabilities (its NLL on the chosen completion's tokens, as the ORPO paper defines it),
KTO's loss with the KL estimate of each micro-batch's mismatched pairs (clamped at 0, no
gradient). Rewards are beta x the policy/reference log-ratio (ORPO: beta x the mean log-prob).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .loss import head_logprobs, head_parts
from .step import token_loss_sum

if TYPE_CHECKING:
    from ..config import MethodConfig
    from ..data.chats import ExampleSet
    from ..data.preference import PreferenceSet
    from .collaborators import Objective


def sequence_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                   sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each sequence's labelled tokens, their count), sequences numbered
    by ``batch["sequence"]``. Only labelled positions go through the head (``head_logprobs``)
    where the model allows it (loss.head_parts, no autocast); otherwise whole logits."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    labels = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    owner = F.pad(batch["sequence"][:, 1:], (0, 1), value=-1)
    keep = labels != -100
    parts = head_parts(model)
    if parts is not None and not torch.is_autocast_enabled(labels.device.type):
        decoder, head = parts
        hidden = decoder(**inputs, use_cache=False).last_hidden_state
        token = head_logprobs(hidden[keep], head.weight, labels[keep])
    else:
        logits = model(**inputs, use_cache=False).logits[keep].float()
        token = logits.gather(1, labels[keep][:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    # A one-hot matmul, not index_add_: a fixed reduction order on every device (no atomics).
    onehot = (owner[keep][None, :] == torch.arange(sequences, device=labels.device)[:, None]).to(token.dtype)
    return onehot @ token, onehot.sum(1)


def _as_collated(self: Any, model: torch.nn.Module, batches: list[Any], step: int | None,
                 position: int | None) -> list[Any]:
    """``prepare``: an objective that learns from its data as it is trains on the collated batches
    (GRPO's samples completions first, grpo.py)."""
    return batches


def _data_tokens(self: Any, dataset: ExampleSet, indices: list[int]) -> int:
    """``target_tokens``: the step's tokens that carry loss, known from the data alone."""
    return dataset.target_tokens(indices)


def _tensors(batch: Any, device: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """A batch's tensors on ``device`` (``prefix``: KTO's KL batch, the prefix dropped)."""
    tensors = getattr(batch, "tensors", batch)
    return {k[len(prefix):]: v.to(device) for k, v in tensors.items()
            if k.startswith(prefix) and (prefix or not k.startswith("kl_"))}


class SFT:
    """Next-token cross entropy on the labelled tokens, normalised by the step's target tokens."""

    name, sequences = "sft", 1
    prepare, target_tokens = _as_collated, _data_tokens

    def weights(self, dataset: ExampleSet, indices: list[int]) -> tuple[int, ...]:
        return (dataset.target_tokens(indices),)

    def terms(self, model: torch.nn.Module, batch: Any, device: str) -> tuple[torch.Tensor, None]:
        loss, _ = token_loss_sum(model, _tensors(batch, device))
        return loss, None

    def combine(self, terms: torch.Tensor, weights: tuple[float, ...]) -> torch.Tensor:
        return terms / weights[0]

    def metrics(self, sums: torch.Tensor, weights: tuple[float, ...]) -> dict[str, float]:
        return {}


def _pair_stats(chosen: torch.Tensor, rejected: torch.Tensor) -> list[torch.Tensor]:
    """Sums over a batch's pairs of their rewards, margins and accuracy."""
    return [chosen.sum(), rejected.sum(), (chosen - rejected).sum(), (chosen > rejected).float().sum()]


PAIR_METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")


class DPO:
    """-log sigmoid(beta x (chosen log-ratio - rejected log-ratio)), the mean over the step's pairs."""

    name, sequences = "dpo", 2
    prepare, target_tokens = _as_collated, _data_tokens

    def __init__(self, method: MethodConfig):
        self.beta = method.beta

    def weights(self, dataset: ExampleSet, indices: list[int]) -> tuple[int, ...]:
        return (len(indices),)

    def terms(self, model: torch.nn.Module, batch: Any, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        tensors = _tensors(batch, device)
        logps, _ = sequence_logps(model, tensors, batch.sequences)
        ratios = logps - tensors["reference"]
        chosen, rejected = ratios.chunk(2)
        losses = -F.logsigmoid(self.beta * (chosen - rejected))
        return losses.sum(), torch.stack(_pair_stats(self.beta * chosen.detach(), self.beta * rejected.detach()))

    def combine(self, terms: torch.Tensor, weights: tuple[float, ...]) -> torch.Tensor:
        return terms / weights[0]

    def metrics(self, sums: torch.Tensor, weights: tuple[float, ...]) -> dict[str, float]:
        return {name: value / max(weights[0], 1) for name, value in zip(PAIR_METRICS, sums.tolist())}


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2 (TRL's)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class ORPO:
    """The chosen completion's NLL per token, minus beta x the mean log-sigmoid of the log odds
    ratio of the pairs' per-token mean log-probabilities. No reference model."""

    name, sequences = "orpo", 2
    prepare, target_tokens = _as_collated, _data_tokens

    def __init__(self, method: MethodConfig):
        self.beta = method.beta

    def weights(self, dataset: PreferenceSet, indices: list[int]) -> tuple[int, ...]:
        return (len(indices), dataset.chosen_tokens(indices))

    def terms(self, model: torch.nn.Module, batch: Any, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        logps, counts = sequence_logps(model, _tensors(batch, device), batch.sequences)
        mean = logps / counts.clamp(min=1)
        chosen, rejected = mean.chunk(2)
        ratio = F.logsigmoid((chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected)))
        nll = -logps.chunk(2)[0].sum()
        stats = _pair_stats(self.beta * chosen.detach(), self.beta * rejected.detach())
        return torch.stack([nll, ratio.sum()]), torch.stack(stats + [nll.detach(), ratio.detach().sum()])

    def combine(self, terms: torch.Tensor, weights: tuple[float, ...]) -> torch.Tensor:
        return terms[0] / max(weights[1], 1) - self.beta * terms[1] / weights[0]

    def metrics(self, sums: torch.Tensor, weights: tuple[float, ...]) -> dict[str, float]:
        values = sums.tolist()
        out = {name: value / max(weights[0], 1) for name, value in zip(PAIR_METRICS, values)}
        out.update(nll=values[4] / max(weights[1], 1), log_odds_ratio=values[5] / max(weights[0], 1))
        return out


class KTO:
    """1 - sigmoid(beta x (log-ratio - KL)) on good lines, 1 - sigmoid(beta x (KL - log-ratio)) on
    bad ones, weighted, the mean over the step's lines; KL is each micro-batch's estimate from its
    mismatched pairs (no gradient, at least 0)."""

    name, sequences = "kto", 1
    prepare, target_tokens = _as_collated, _data_tokens

    def __init__(self, method: MethodConfig):
        self.beta, self.desirable, self.undesirable = method.beta, method.desirable_weight, method.undesirable_weight

    def weights(self, dataset: ExampleSet, indices: list[int]) -> tuple[int, ...]:
        return (len(indices),)

    def terms(self, model: torch.nn.Module, batch: Any, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        tensors, mismatched, n = _tensors(batch, device), _tensors(batch, device, "kl_"), batch.sequences
        with torch.no_grad():  # as TRL: the KL term carries no gradient
            kl_logps, _ = sequence_logps(model, mismatched, n)
        kl = (kl_logps - mismatched["reference"]).mean().clamp(min=0)
        logps, _ = sequence_logps(model, tensors, n)
        ratios = logps - tensors["reference"]
        good = tensors["label"].bool()
        losses = torch.where(good, self.desirable * (1 - torch.sigmoid(self.beta * (ratios - kl))),
                             self.undesirable * (1 - torch.sigmoid(self.beta * (kl - ratios))))
        rewards = self.beta * ratios.detach()
        right = torch.where(good, rewards > 0, rewards < 0).float()
        return losses.sum(), torch.stack([rewards[good].sum(), rewards[~good].sum(), right.sum(), kl.detach() * n,
                                          good.float().sum()])

    def combine(self, terms: torch.Tensor, weights: tuple[float, ...]) -> torch.Tensor:
        return terms / weights[0]

    def metrics(self, sums: torch.Tensor, weights: tuple[float, ...]) -> dict[str, float]:
        chosen, rejected, right, kl, good = sums.tolist()
        lines = max(weights[0], 1)
        bad = weights[0] - good
        out = {"reward_accuracy": right / lines, "kl": kl / lines}
        if good:
            out["rewards_chosen"] = chosen / good
        if bad:
            out["rewards_rejected"] = rejected / bad
        if good and bad:
            out["reward_margin"] = out["rewards_chosen"] - out["rewards_rejected"]
        return out


OBJECTIVES: dict[str, Any] = {"sft": SFT, "dpo": DPO, "orpo": ORPO, "kto": KTO}


def make_objective(method: MethodConfig) -> Objective:
    """The objective of a job's [method]."""
    kind = OBJECTIVES[getattr(method, "objective", "sft")]
    return kind() if kind is SFT else kind(method)
