"""lodger's GRPO loss against TRL's own (trl 1.16.0): ``GRPOTrainer._compute_loss`` itself, run on
a deep copy of the same tiny LoRA model (its forward patched by TRL's ``add_fused_lm_head``, as TRL
does), fed the same prompts, completions, advantages and the same old and reference
log-probabilities. Compared: the loss and every LoRA gradient, for each loss type lodger calls
exact against TRL (dapo, grpo, dr_grpo), with a KL term and with ratios that clip on both sides.

What TRL's side is given: ``_compute_loss`` needs a trainer for its settings, an accelerator and
its metrics table; a namespace holds exactly the attributes that method reads (one process, one
accumulation step, no vLLM, no entropy masking or bonus), so the computation is TRL's code, not a
copy. Prompts of equal length: TRL's forward is given no position ids, so a left-padded prompt's
tokens sit at shifted positions there; lodger lays each row out right-padded (rollout.py), which
is the same computation when no row is left-padded.

Also: the advantages of a reward table (TRL's ``nanstd`` and its order of operations, with a
function returning None for some completions and a whole group of equal rewards).

Tolerance: fp32 on both sides; the per-token log-probabilities differ only in summation order
(lodger divides the hidden states by the temperature before the head, TRL the logits after it;
both chunk the head), about 1e-7 relative. Measured here: the losses within 5e-7 relative (dapo
2e-7, grpo 4e-7, dr_grpo 5e-7), the largest gradient difference 1.1e-8 to 1.8e-8 against largest
gradients of 0.024 to 0.046 (under 1e-6 of them). The bounds (loss rel 1e-5, gradients rtol 1e-4,
atol 1e-7) are well above that and far below a real mistake (a wrong normaliser moves the loss by
a factor, a clipping bound or sign by far more than 1e-4).
"""

from __future__ import annotations

import copy
import functools
from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")

TRL_VERSION = "1.16.0"
G, PROMPT, LENGTH, TEMPERATURE = 4, 6, 8, 0.7


class _Accelerator:
    num_processes, is_main_process = 1, True

    def autocast(self):
        return nullcontext()

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def _trl_self(loss_type: str, beta: float, epsilon: float, epsilon_high: float):
    """The attributes ``GRPOTrainer._compute_loss`` reads, as one process with no extras would have them."""
    from trl import GRPOTrainer

    trainer = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        loss_type=loss_type, epsilon_low=epsilon, epsilon_high=epsilon_high, use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=LENGTH, accelerator=_Accelerator(),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1))
    trainer._get_per_token_logps_and_entropies = functools.partial(GRPOTrainer._get_per_token_logps_and_entropies,
                                                                   trainer)
    return trainer


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    import trl

    from lodger.config import MethodConfig
    from lodger.model import attach_method, load_base_model, load_tokenizer

    assert trl.__version__ == TRL_VERSION, f"the anchor is trl {TRL_VERSION}; installed {trl.__version__}"
    tokenizer = load_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    model = attach_method(load_base_model(tiny_model_dir), MethodConfig(rank=4, alpha=8.0), 0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a trained adapter: LoRA B away from zero, so the adapter matters
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    vocab, eos, pad = len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts = [torch.randint(3, vocab, (PROMPT,), generator=gen).tolist() for _ in range(2)]
    rows = [p for p in prompts for _ in range(G)]
    completions = []
    for r in range(len(rows)):
        n = [LENGTH, 3, 5, LENGTH, 2, 7, LENGTH, 4][r]
        tokens = torch.randint(3, vocab, (n,), generator=gen).tolist()
        completions.append(tokens if n == LENGTH else tokens[:-1] + [eos])  # some end, some are cut
    return {"model": model, "tokenizer": tokenizer, "rows": rows, "completions": completions, "pad": pad,
            "eos": eos, "gen": gen}


def _lodger_side(setup, cfg, tensors):
    from lodger.train.grpo import GRPO
    from lodger.train.precision import Precision

    rewards = SimpleNamespace(labels=["r"], weights=[1.0])
    sync = SimpleNamespace(sum_across=lambda values: values)
    objective = GRPO(cfg, rewards, tokenizer=setup["tokenizer"], dataset=None, eval_set=None,
                     precision=Precision("fp32", "cpu"), device="cpu", sync=sync, progress=SimpleNamespace(step=0))
    from lodger.train.rollout import Rollout

    rollout = Rollout(tensors, list(range(len(setup["rows"]))), 2)
    objective.totals = (float(rollout.rows), float(rollout.target_tokens))
    model = setup["model"]
    model.zero_grad(set_to_none=True)
    terms, sums = objective.terms(model, rollout, "cpu")
    loss = objective.combine(terms, objective.weights(None, []))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, objective.metrics(sums, objective.weights(None, []))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_grpo_loss_and_gradients_equal_trls(setup, loss_type):
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    from lodger.config.grpo import GRPOConfig
    from lodger.train.grpo import token_logps
    from lodger.train.rollout import layout

    cfg = GRPOConfig(num_generations=G, max_completion_length=LENGTH, temperature=TEMPERATURE, beta=0.04,
                     epsilon=0.2, epsilon_high=0.28, loss_type=loss_type, num_iterations=2)
    tensors = layout(setup["rows"], setup["completions"], setup["pad"], False, LENGTH, {setup["eos"]})
    gen = torch.Generator().manual_seed({"dapo": 2, "grpo": 3, "dr_grpo": 4}[loss_type])
    with torch.no_grad():
        now = token_logps(setup["model"], tensors, TEMPERATURE)
    keep = tensors["mask"] > 0
    # old and reference log-probabilities away from the current ones, so ratios clip on both sides
    old = torch.where(keep, now + torch.randn(now.shape, generator=gen) * 0.3, torch.zeros_like(now))
    ref = torch.where(keep, now + torch.randn(now.shape, generator=gen) * 0.2, torch.zeros_like(now))
    advantages = torch.randn(len(setup["rows"]), generator=gen)
    rows = len(setup["rows"])
    tensors.update(old_logps=old, ref_logps=ref, advantages=advantages, rewards=torch.randn(rows, 1, generator=gen),
                   total=torch.randn(rows, generator=gen), zero_std=torch.zeros(2, dtype=torch.bool))
    loss, grads, metrics = _lodger_side(setup, cfg, tensors)
    assert 0 < metrics["clip_ratio_low"] and 0 < metrics["clip_ratio_high"], metrics  # both bounds bite

    trl_model = copy.deepcopy(setup["model"])
    add_fused_lm_head(trl_model.get_base_model(), temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    # TRL's completion-aligned tensors: completion token k sits at lodger's grid column PROMPT - 1 + k
    completion_ids = torch.full((rows, LENGTH), setup["pad"], dtype=torch.long)
    completion_mask = torch.zeros((rows, LENGTH), dtype=torch.long)
    for r, tokens in enumerate(setup["completions"]):
        completion_ids[r, :len(tokens)] = torch.tensor(tokens)
        completion_mask[r, :len(tokens)] = 1
    window = slice(PROMPT - 1, PROMPT - 1 + LENGTH)
    grid = lambda t: torch.nn.functional.pad(t, (0, PROMPT - 1 + LENGTH - t.shape[1]))[:, window]  # noqa: E731
    inputs = {"prompt_ids": torch.tensor(setup["rows"]), "prompt_mask": torch.ones((rows, PROMPT), dtype=torch.long),
              "completion_ids": completion_ids, "completion_mask": completion_mask, "advantages": advantages,
              "old_per_token_logps": grid(old), "ref_per_token_logps": grid(ref),
              "num_items_in_batch": completion_mask.sum()}
    trainer = _trl_self(loss_type, cfg.beta, cfg.epsilon, cfg.epsilon_high)
    trl_model.zero_grad(set_to_none=True)
    trl_loss = GRPOTrainer._compute_loss(trainer, trl_model, inputs)
    trl_loss.backward()
    trl_grads = {n: p.grad for n, p in trl_model.named_parameters() if p.grad is not None}

    trl_value = float(trl_loss.detach())
    assert abs(float(loss) - trl_value) <= 1e-5 * abs(trl_value), (float(loss), trl_value)
    assert set(grads) == set(trl_grads) and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, trl_grads[name], rtol=1e-4, atol=1e-7, msg=name)
    # and the logged numbers: TRL's KL and clip ratios over the completion tokens
    for ours, theirs in (("kl", "kl"), ("clip_ratio_low", "clip_ratio/low_mean"),
                         ("clip_ratio_high", "clip_ratio/high_mean"), ("clip_ratio", "clip_ratio/region_mean")):
        assert metrics[ours] == pytest.approx(trainer._metrics["train"][theirs][-1], rel=1e-5, abs=1e-7), ours


def test_advantages_follow_trls_normalisation_with_none_and_equal_groups():
    from trl.trainer.utils import nanstd

    from lodger.train.rollout import advantages

    nan = float("nan")
    # two functions; group 1 has varied rewards, group 2 all equal, one completion unscorable (every function None)
    table = torch.tensor([[1.0, 0.5], [0.0, nan], [1.0, 0.0], [0.0, 1.0],
                          [0.5, 0.5], [0.5, 0.5], [nan, nan], [0.5, 0.5]])
    weights = torch.tensor([1.0, 0.5])
    total, advantage, zero_std = advantages(table, weights, 4, scale=True)
    # TRL 1.16, _generate_and_score_completions, sum_then_normalize and scale_rewards="group", as written there
    rewards = (table * weights.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(table).all(dim=1)] = torch.nan
    mean = torch.nanmean(rewards.view(-1, 4), dim=1).repeat_interleave(4, dim=0)
    std = nanstd(rewards.view(-1, 4), dim=1).repeat_interleave(4, dim=0)
    expected = torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)
    assert torch.equal(advantage, expected)
    assert torch.equal(torch.isnan(total), torch.isnan(rewards))
    assert zero_std.tolist() == [False] * 4 + [True] * 4  # the second group carries no signal
    assert advantage[6] == 0.0  # the unscorable completion moves nothing
    unscaled = advantages(table, weights, 4, scale=False)[1]
    assert torch.equal(unscaled, torch.nan_to_num(rewards - mean, nan=0.0))


def test_nanstd_is_trls_to_the_bit_on_random_groups_with_nan():
    # One hand-made table agreed to the bit on one CPU and not on another (the Bessel correction
    # applied as ``variance * count / (count - 1)``, not TRL's rounded ``count / (count - 1)``):
    # many random groups of every size, with NaN holes, catch an order of operations anywhere.
    from trl.trainer.utils import nanstd as trls

    from lodger.train.rollout import nanstd

    generator = torch.Generator().manual_seed(0)
    for size in range(1, 9):
        values = torch.randn(200, size, generator=generator) * torch.rand(200, 1, generator=generator) * 10
        values[torch.rand(200, size, generator=generator) < 0.3] = torch.nan
        ours, theirs = nanstd(values, dim=1), trls(values, dim=1)
        assert torch.equal(torch.isnan(ours), torch.isnan(theirs)), size
        assert torch.equal(ours.nan_to_num(), theirs.nan_to_num()), (size, (ours - theirs).abs().nan_to_num().max())
