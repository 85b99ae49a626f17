"""The head-only loss (train/loss.py) against whole logits, on the tiny Llama: same loss and same
gradients (within float summation order) for full fine-tuning with tied embeddings and for LoRA,
with chunks small enough that every step takes several."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _batch(vocab: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 31:] = 0  # a padded row
    labels = torch.where(mask.bool(), ids, torch.tensor(-100))
    labels[:, :12] = -100  # the prompt carries no labels, as in chats
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _whole_logits_loss(model, batch):
    """What token_loss_sum computed before loss.py: the whole logits through cross entropy."""
    import torch.nn.functional as F

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    labels = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                           ignore_index=-100, reduction="sum")


def _grads(model, loss_fn, batch):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(model, batch):
    from lodger.train.step import token_loss_sum

    assert _head_used(model)
    fused, fused_grads = _grads(model, lambda m, b: token_loss_sum(m, b)[0], batch)
    whole, whole_grads = _grads(model, _whole_logits_loss, batch)
    assert fused_grads.keys() == whole_grads.keys() and fused_grads
    torch.testing.assert_close(fused, whole, rtol=1e-5, atol=1e-4)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    return fused


def _head_used(model) -> bool:
    from lodger.train.loss import head_parts

    return head_parts(model) is not None


@pytest.fixture
def model(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from lodger.train import loss

    # a chunk of 7 rows for this vocabulary: the labelled positions take several chunks
    monkeypatch.setattr(loss, "CHUNK_BYTES", 7 * 4 * 400)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)


def test_full_fine_tuning_tied_head_matches_whole_logits(model):
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    loss = _compare(model, _batch(model.config.vocab_size))
    assert loss.item() > 0


def test_lora_matches_whole_logits_and_eval_computes_no_gradient(model):
    from peft import LoraConfig, get_peft_model

    from lodger.train.step import token_loss_sum

    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    batch = _batch(model.config.vocab_size, seed=5)
    trained = _compare(lora, batch)
    lora.zero_grad(set_to_none=True)
    with torch.no_grad():
        loss, n = token_loss_sum(lora, batch)
    assert not loss.requires_grad and n == int((batch["labels"][:, 1:] != -100).sum())
    torch.testing.assert_close(loss, trained)


def test_a_lora_wrapped_head_keeps_whole_logits(model):
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    assert not _head_used(lora)
