"""lodger's preference losses against TRL's own (trl 1.16.0), on the same tiny model, data, seed
and hyper-parameters: the loss, the logged rewards and every LoRA gradient of one micro-batch.

DPO and KTO run TRL's real trainers (DPOTrainer / KTOTrainer: their tokenisation, collator and
``_compute_loss``), so what is compared is TRL's whole path from the JSONL rows to the gradient:
first the tokenised sequences must be identical, then the losses. ORPO's trainer is TRL's
experimental one (plain-string prompts, its own tokeniser path, an NLL over the prompt too), so
ORPO is compared against TRL's ``odds_ratio_loss`` and ``get_batch_logps`` on the same batch, with
the NLL on the chosen completion's tokens as the ORPO paper defines it.

Both sides start from the same weights with nonzero LoRA B (so the log-ratios are not zero). TRL,
given a model that already has an adapter, keeps a copy of it as the reference ("ref" adapter):
the model as it is when training starts, which is lodger's reference too. Both then move away
from it by the same perturbation, so the losses are not at their trivial value.

Tolerance: fp32 on both sides; the sums differ only in order (lodger sums each sequence's token
log-probs through a one-hot matmul and computes logits in chunks, TRL in tiles with a masked
scatter), about 1e-7 relative per sum of a few dozen terms. Measured here: DPO's loss equal to the
last bit, KTO's and ORPO's within 1e-7 relative; the largest gradient difference 1e-9 (DPO),
3e-9 (KTO) and 1.5e-8 (ORPO) against largest gradients of 5e-4, 0.015 and 0.055, i.e. within
3e-7 of them. The bounds below (losses rel 1e-6; gradients rtol 1e-5, atol 1e-7) are a few to
a hundred times those and far below the size of any real mistake (a wrong sign, beta,
normaliser or masked token moves the loss in the third digit).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("trl")

from fixtures_lib import write_preference_jsonl  # noqa: E402

TRL_VERSION = "1.16.0"
MAX_LENGTH = 64


@pytest.fixture(scope="module")
def trl_version():
    import trl

    assert trl.__version__ == TRL_VERSION, f"the anchor is trl {TRL_VERSION}; installed {trl.__version__}"
    return trl.__version__


class Pair:
    """lodger's model and data, and a deep copy of the model for TRL (the same weights)."""

    def __init__(self, folder, path, objective: str):
        from lodger.config import MethodConfig
        from lodger.data.chats import read_jsonl
        from lodger.model import attach_method, load_base_model, load_tokenizer, tokenizer_hash
        from lodger.data.preference import row_checker, tokenize_preference
        from lodger.train.objective import make_objective
        from lodger.train.precision import Precision

        self.method = MethodConfig(objective=objective, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
        self.tokenizer = load_tokenizer(folder)
        self.rows = [json.loads(line) for line in path.read_text().splitlines()]
        self.dataset = tokenize_preference(read_jsonl(path, row_checker(objective)), self.tokenizer,
                                           tokenizer_hash(folder), MAX_LENGTH, objective, kl_block=4)
        torch.manual_seed(0)
        self.model = attach_method(load_base_model(folder), self.method, 0)
        self.objective = make_objective(self.method)
        self.precision = Precision("fp32", "cpu")
        self.generator = torch.Generator().manual_seed(1)
        self.perturb(self.model)  # a trained adapter as the start (and the reference)
        if objective != "orpo":
            from lodger.train import reference

            self.dataset.reference = reference.compute(self.model, self.dataset, batch_size=4,
                                                       precision=self.precision, device="cpu",
                                                       pad_id=self.tokenizer.pad_token_id)
        self.trl_model = copy.deepcopy(self.model)

    def perturb(self, *models) -> None:
        with torch.no_grad():
            for name, p in models[0].named_parameters():
                if "lora_B" in name:
                    value = torch.randn(p.shape, generator=self.generator) * 0.5
                    for m in models:
                        dict(m.named_parameters())[name].copy_(value)

    def lodger_step(self, indices: list[int]):
        """lodger's loss, metrics and LoRA gradients of one micro-batch (the loop's micro_step)."""
        from lodger.data.packing import padded_batch
        from lodger.train.step import micro_step

        self.model.train()
        batch = padded_batch(self.dataset, indices, self.tokenizer.pad_token_id)
        weights = self.objective.weights(self.dataset, indices)
        loss, sums = micro_step(self.objective, self.model, batch, self.precision, "cpu", weights)
        return loss.item(), self.objective.metrics(sums, weights), grads(self.model)


def grads(model) -> dict[str, torch.Tensor]:
    return {n.replace(".default.", "."): p.grad.clone() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None and ".ref." not in n}


def assert_same_grads(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-7, msg=name)


def _same_sequences(dataset, prompt_ids, completions, i: int) -> None:
    """lodger's i-th example's sequences and loss masks are TRL's tokenised ones, cut as TRL's collator cuts."""
    for (ids, mask), completion in zip(dataset.sequences(i), completions):
        assert ids.tolist() == (prompt_ids + completion)[:MAX_LENGTH]
        assert mask.tolist() == ([0] * len(prompt_ids) + [1] * len(completion))[:MAX_LENGTH]


def test_dpo_matches_trl_dpo_trainer(tmp_path, tiny_model_dir, trl_version):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    side = Pair(tiny_model_dir, write_preference_jsonl(tmp_path / "dpo.jsonl", 8, 0, "dpo"), "dpo")
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, max_length=MAX_LENGTH,
                     beta=side.method.beta, report_to=[], use_cpu=True, seed=0, remove_unused_columns=False)
    trainer = DPOTrainer(model=side.trl_model, args=args, train_dataset=Dataset.from_list(side.rows),
                         processing_class=side.tokenizer)
    data = trainer.train_dataset
    for i in range(len(side.rows)):
        _same_sequences(side.dataset, data[i]["prompt_ids"], [data[i]["chosen_ids"], data[i]["rejected_ids"]], i)
    side.perturb(side.model, side.trl_model)  # both move away from the reference alike
    indices = [0, 1, 2, 3]
    loss, metrics, ours = side.lodger_step(indices)
    side.trl_model.train()
    trl_loss = trainer._compute_loss(side.trl_model, trainer.data_collator([data[i] for i in indices]), False)
    trl_loss.backward()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert loss == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-7)
    assert abs(loss - 0.6931471805599453) > 1e-4  # not the trivial loss of policy == reference
    for ours_key, trl_key in (("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected"),
                              ("reward_margin", "rewards/margins"), ("reward_accuracy", "rewards/accuracies")):
        assert metrics[ours_key] == pytest.approx(logged[trl_key], rel=1e-5, abs=1e-6), ours_key
    assert_same_grads(ours, grads(side.trl_model))


def test_kto_matches_trl_kto_trainer(tmp_path, tiny_model_dir, trl_version):
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    side = Pair(tiny_model_dir, write_preference_jsonl(tmp_path / "kto.jsonl", 8, 0, "kto"), "kto")
    args = KTOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, max_length=MAX_LENGTH,
                     beta=side.method.beta, report_to=[], use_cpu=True, seed=0, remove_unused_columns=False)
    trainer = KTOTrainer(model=side.trl_model, args=args, train_dataset=Dataset.from_list(side.rows),
                         processing_class=side.tokenizer)
    data = trainer.train_dataset
    for i in range(len(side.rows)):
        _same_sequences(side.dataset, data[i]["prompt_ids"], [data[i]["completion_ids"]], i)
        kl_ids, _ = side.dataset.sequences(i, kl=True)[0]
        assert kl_ids.tolist() == (data[i]["prompt_ids"] + data[i]["KL_completion_ids"])[:MAX_LENGTH]
    side.perturb(side.model, side.trl_model)
    indices = [0, 1, 2, 3]  # one of TRL's KL blocks (its KL pairs rotate within batches of 4 lines)
    loss, metrics, ours = side.lodger_step(indices)
    side.trl_model.train()
    trl_loss = trainer._compute_loss(side.trl_model, trainer.data_collator([data[i] for i in indices]), False)
    trl_loss.backward()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert loss == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-7)
    assert metrics["kl"] == pytest.approx(logged["kl"], rel=1e-5, abs=1e-7)
    for ours_key, trl_key in (("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected"),
                              ("reward_margin", "rewards/margins")):
        assert metrics[ours_key] == pytest.approx(logged[trl_key], rel=1e-5, abs=1e-6), ours_key
    assert_same_grads(ours, grads(side.trl_model))


def test_orpo_matches_trl_odds_ratio_loss(tmp_path, tiny_model_dir, trl_version):
    from types import SimpleNamespace

    from trl.experimental.orpo import ORPOTrainer

    from lodger.data.packing import padded_batch

    side = Pair(tiny_model_dir, write_preference_jsonl(tmp_path / "orpo.jsonl", 8, 0, "orpo"), "orpo")
    indices = [0, 1, 2, 3]
    loss, metrics, ours = side.lodger_step(indices)
    # TRL's side on the same padded batch (chosen rows, then rejected rows, as TRL concatenates them)
    batch = padded_batch(side.dataset, indices, side.tokenizer.pad_token_id).tensors
    side.trl_model.train()
    logits = side.trl_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps = ORPOTrainer.get_batch_logps(logits, batch["labels"], average_log_prob=True)
    chosen, rejected = logps.chunk(2)
    trl = SimpleNamespace(beta=side.method.beta, accelerator=SimpleNamespace(device="cpu"))
    losses, chosen_rewards, rejected_rewards, _, _ = ORPOTrainer.odds_ratio_loss(trl, chosen, rejected)
    n = len(indices)
    # The NLL on the chosen completions' tokens (TRL's cross_entropy_loss, on the completion labels)
    nll = torch.nn.functional.cross_entropy(logits[:n, :-1].reshape(-1, logits.size(-1)),
                                            batch["labels"][:n, 1:].reshape(-1), ignore_index=-100)
    trl_loss = nll - losses.mean()
    trl_loss.backward()
    assert loss == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-7)
    assert metrics["rewards_chosen"] == pytest.approx(chosen_rewards.mean().item(), rel=1e-5, abs=1e-7)
    assert metrics["rewards_rejected"] == pytest.approx(rejected_rewards.mean().item(), rel=1e-5, abs=1e-7)
    assert metrics["nll"] == pytest.approx(nll.item(), rel=1e-6)
    assert_same_grads(ours, grads(side.trl_model))
