"""Sanity checks for the shared tiny-model fixtures (tests/conftest.py, tests/fixtures_lib.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fixtures_lib import build_tiny_model


def test_env_is_isolated(lodger_home: Path, tmp_path: Path) -> None:
    assert os.environ["LODGER_HOME"] == str(lodger_home)
    assert lodger_home.is_dir() and lodger_home.parent == tmp_path
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_tiny_model_loads_and_trains_forward(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_model_dir / name).is_file(), name

    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)

    assert model.config.model_type == "llama"
    assert model.config.vocab_size == len(tok)
    assert 300 <= len(tok) <= 512
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    assert tok.pad_token_id == tok.eos_token_id == model.config.eos_token_id
    assert tok.convert_tokens_to_ids("<|im_start|>") != tok.unk_token_id

    enc = tok(["What is 3 + 4?", "Reverse the words: cat dog"], padding=True,
              return_tensors="pt", return_offsets_mapping=True)
    offsets = enc.pop("offset_mapping")
    assert offsets.shape[:2] == enc["input_ids"].shape
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    out = model(**enc, labels=labels)
    assert out.logits.shape == (*enc["input_ids"].shape, len(tok))
    assert torch.isfinite(out.loss) and out.loss.item() > 0
    out.loss.backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_chat_template_prefix_property(tiny_model_dir: Path, chat_data: dict) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    records = [json.loads(line) for line in chat_data["train"].read_text().splitlines()]
    assert len(records) == 64
    assert len(chat_data["eval"].read_text().splitlines()) == 16
    assert any(r["messages"][0]["role"] == "system" for r in records)
    multi = [r for r in records if sum(m["role"] == "assistant" for m in r["messages"]) > 1]
    assert multi

    for rec in [multi[0], *records[:8]]:
        msgs = rec["messages"]
        full = tok.apply_chat_template(msgs, tokenize=False)
        assert full.endswith("<|im_end|>\n")
        for m in msgs:
            assert f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" in full
        for i in range(1, len(msgs)):
            if msgs[i]["role"] != "assistant":
                continue
            prompt = tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
            longer = tok.apply_chat_template(msgs[: i + 1], tokenize=False)
            assert prompt.endswith("<|im_start|>assistant\n")
            assert longer.startswith(prompt)

    # offsets cover the rendered text contiguously (trim_offsets=False)
    enc = tok(full, return_offsets_mapping=True, add_special_tokens=False)
    assert enc["offset_mapping"][0][0] == 0 and enc["offset_mapping"][-1][1] == len(full)
    assert tok.decode(enc["input_ids"]) == full


def test_build_is_deterministic(tmp_path: Path, tiny_model_dir: Path) -> None:
    a = build_tiny_model(tmp_path / "a", seed=0)
    b = build_tiny_model(tmp_path / "b", seed=1)
    ref = (tiny_model_dir / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() == ref
    assert (b / "model.safetensors").read_bytes() != ref
    assert (a / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
