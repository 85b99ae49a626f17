"""lodger's adapters are plain peft adapters: anyone can load them without lodger.

Uses the session's baseline run (the standard job, trained to the end).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import TOTAL_STEPS, checkpoint_dirs


@pytest.fixture(scope="module")
def torch_setup():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels for every model compared below
    yield torch
    torch.set_num_threads(threads)


def _inputs(tiny_model_dir: Path, e2e_data):
    import json

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    chats = [json.loads(line)["messages"] for line in e2e_data["eval"].read_text().splitlines()[:4]]
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in chats]
    return tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)


def _logits(model, batch):
    import torch

    model.eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits


def _plain_peft(tiny_model_dir: Path, adapter_dir: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter_dir)


def test_final_adapter_and_last_checkpoint_load_with_plain_peft_and_match_lodger(
        torch_setup, baseline, tiny_model_dir, e2e_data):
    torch = torch_setup
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lodger.lifecycle.jobfile import load_job
    from lodger.model import attach_method, load_base_model, load_trainable_state

    last = baseline.run_dir / "checkpoints" / checkpoint_dirs(baseline.run_dir)[-1]
    assert last.name == f"step-{TOTAL_STEPS:08d}"
    adapter = baseline.run_dir / "adapter"
    assert (adapter / "adapter_model.safetensors").read_bytes() == (last / "adapter_model.safetensors").read_bytes()
    batch = _inputs(tiny_model_dir, e2e_data)

    from_final = _logits(_plain_peft(tiny_model_dir, adapter), batch)
    from_checkpoint = _logits(_plain_peft(tiny_model_dir, last), batch)

    job = load_job(baseline.run_dir / "job.toml")
    ours = attach_method(load_base_model(tiny_model_dir), job.method, job.training.seed)
    load_trainable_state(ours, job.method, load_file(last / "adapter_model.safetensors"))
    from_lodger = _logits(ours, batch)

    base = _logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir), batch)
    assert not torch.equal(from_final, base), "the adapter must change the model (did it load at all?)"
    assert torch.equal(from_final, from_lodger), (from_final - from_lodger).abs().max()
    assert torch.equal(from_checkpoint, from_lodger)
