"""A LoRA adapter on a quantised base ([method] base_bits = 4 or 8, DoRA, rsLoRA): the real `lodger`
command on the tiny Llama, killed with SIGKILL and resumed to the bits of the uninterrupted run; the
checkpoint names the quantised base by its sha256, provenance records the quantisation, and
`compare` says when two runs' bases differ in precision; bad input is refused before anything is
written."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest

from helpers import (STANDARD_JOB, TOTAL_STEPS, checkpoint_dirs, describe, eval_losses, final_adapter_bytes,
                     killed_by_sigkill, lodger_env, run_dir_of, run_lodger, start_lodger, train_records,
                     wait_for_step, write_job)

VARIANTS = {4: {"base_bits": 4, "use_dora": True}, 8: {"base_bits": 8, "use_rslora": True}}


@pytest.fixture(scope="module")
def quantised_jobs(tmp_path_factory, tiny_model_dir, e2e_data) -> dict[int, Path]:
    folder = tmp_path_factory.mktemp("qlora_jobs")
    return {bits: write_job(folder / f"job{bits}.toml", model=tiny_model_dir, train=e2e_data["train"],
                            eval=e2e_data["eval"], name=f"q{bits}", extra={"method": method}, **STANDARD_JOB)
            for bits, method in VARIANTS.items()}


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    """A small well-formed GGUF file (the refusal comes before it is read)."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _run(job: Path, home: Path) -> tuple[str, Path]:
    env = lodger_env(home)
    result = run_lodger(["run", job, "--quiet"], env)
    assert result.returncode == 0, describe(result)
    run_id = result.stdout.splitlines()[0].split()[1]
    return run_id, run_dir_of(run_id, env)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantised_run_sigkilled_at_a_random_step_resumes_bitwise_equal(bits, quantised_jobs, tmp_path):
    _, straight = _run(quantised_jobs[bits], tmp_path / "straight")
    seed = int(os.environ.get("LODGER_TEST_SEED") or random.randrange(2**32))
    kill_at = random.Random(seed).randrange(2, 19)  # a kill never lands after the end (>= 6 steps margin)
    print(f"kill seed {seed} (rerun with LODGER_TEST_SEED={seed}); kill at step >= {kill_at}")
    env = lodger_env(tmp_path / "killed")
    proc = start_lodger(["run", quantised_jobs[bits]], env, log_dir=tmp_path)
    try:
        run_id = proc.run_id()
        folder = run_dir_of(run_id, env)
        wait_for_step(folder, kill_at, proc)
        proc.kill(signal.SIGKILL)
        assert killed_by_sigkill(proc.wait()), describe(proc)
        proc = start_lodger(["resume", run_id], env, log_dir=tmp_path)
        assert proc.wait() == 0, describe(proc)
    finally:
        proc.close()
    assert [r["step"] for r in train_records(folder)] == list(range(1, TOTAL_STEPS + 1))
    assert train_records(folder) == train_records(straight), "per-step records differ from the uninterrupted run"
    assert eval_losses(folder) == eval_losses(straight)
    assert final_adapter_bytes(folder) == final_adapter_bytes(straight)
    # The checkpoint names the quantised base instead of holding it: no base weights among its files.
    newest = folder / "checkpoints" / checkpoint_dirs(folder)[-1]
    base = json.loads((newest / "state.json").read_text())["base"]
    assert base["bits"] == bits and base["library"] == "bitsandbytes" and len(base["sha256"]) == 64
    assert sum(f.stat().st_size for f in newest.iterdir()) < 200_000, sorted(p.name for p in newest.iterdir())
    adapter = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert adapter["use_dora"] is (bits == 4) and adapter["use_rslora"] is (bits == 8)


def test_provenance_and_compare_say_the_base_was_quantised(quantised_jobs, tiny_model_dir, e2e_data, tmp_path):
    home, short = tmp_path / "home", {**STANDARD_JOB, "steps": 4, "eval_every": None}
    four_job = write_job(tmp_path / "four.toml", model=tiny_model_dir, train=e2e_data["train"], eval=e2e_data["eval"],
                         name="four", extra={"method": VARIANTS[4]}, **short)
    plain_job = write_job(tmp_path / "plain.toml", model=tiny_model_dir, train=e2e_data["train"],
                          eval=e2e_data["eval"], name="plain", **short)
    four, _ = _run(four_job, home)
    plain, _ = _run(plain_job, home)
    env = lodger_env(home)
    shown = run_lodger(["show", four, "--json"], env)
    assert shown.returncode == 0, describe(shown)
    quantisation = json.loads(shown.stdout)["provenance"][-1]["model"]["quantisation"]
    assert (quantisation["bits"], quantisation["format"], quantisation["library"]) == (4, "nf4", "bitsandbytes")
    assert quantisation["version"] and quantisation["double_quant"] is True
    compared = run_lodger(["compare", four, plain], env)
    assert "base precision: 4-bit NF4 (double quantisation, bitsandbytes" in compared.stdout, describe(compared)
    assert "vs fp32" in compared.stdout, describe(compared)


@pytest.mark.parametrize("method, source, expected", [
    ({"kind": "full", "base_bits": 4}, "tiny", "a quantised base is frozen and only a LoRA adapter trains on it"),
    ({"base_bits": 4}, "gguf", "a GGUF file is already quantised"),
    ({"use_dora": True, "init_adapter": "adapter"}, "tiny", "no magnitude vectors for DoRA to continue"),
    ({"use_dora": True, "kind": "full"}, "tiny", "it is a variant of the LoRA adapter"),
], ids=["4bit-full", "gguf-again", "dora-init-adapter", "dora-full"])
def test_bad_quantisation_input_is_refused_and_nothing_is_written(method, source, expected, tiny_model_dir,
                                                                  tiny_gguf, e2e_data, tmp_path):
    model = tiny_gguf if source == "gguf" else tiny_model_dir
    job = write_job(tmp_path / "job.toml", model=model, train=e2e_data["train"], steps=2,
                    extra={"method": dict(method)})
    home = tmp_path / "home"
    result = run_lodger(["run", job], lodger_env(home))
    assert result.returncode != 0 and expected in result.stderr, describe(result)
    assert not (home / "runs").exists() or not any((home / "runs").iterdir()), "a run folder was written"


def test_an_export_of_a_4bit_dora_run_merges_into_the_dequantised_base_and_its_card_loads_the_quantised_one(
        e2e_data, tmp_path):
    """merged/ is the quantised base dequantised to fp32 with the DoRA adapter merged: its logits are
    lodger's model's (the 4-bit base and the adapter); the f32 GGUF holds the same weights; the
    card's peft snippet, which quantises the named base as in training, runs in a fresh process.
    The model is 64 wide: a stranger's generation runs bitsandbytes' CPU inference kernel, which
    needs layers of at least one 64-value block per row (the 32-wide tiny model fails there)."""
    import re
    import subprocess
    import sys

    import torch
    from fixtures_lib import build_tiny_model
    from transformers import AutoModelForCausalLM

    from lodger.config.model import MethodConfig
    from lodger.model import attach_method, load_base_model, load_trainable_state

    tiny_model_dir = build_tiny_model(tmp_path / "model", hidden=64, intermediate=128)
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=e2e_data["train"], name="q4x",
                    extra={"method": VARIANTS[4]}, **{**STANDARD_JOB, "steps": 4, "eval_every": None, "dropout": 0.0})
    home = tmp_path / "home"
    run_id, folder = _run(job, home)
    dest = tmp_path / "out"
    result = run_lodger(["export", run_id, dest, "--format", "peft,merged,gguf", "--outtype", "f32"], lodger_env(home))
    assert result.returncode == 0, describe(result)

    method = MethodConfig(rank=4, alpha=8.0, **VARIANTS[4])
    from safetensors.torch import load_file

    lodger_model = attach_method(load_base_model(tiny_model_dir, method), method, 0)
    load_trainable_state(lodger_model, method, load_file(str(folder / "adapter" / "adapter_model.safetensors")))
    ids = torch.tensor([[1, 5, 9, 14, 20, 27, 33, 40]])
    with torch.no_grad():
        expected = lodger_model.eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(dest / "merged").eval()(input_ids=ids).logits
        from_gguf = AutoModelForCausalLM.from_pretrained(dest / "gguf", gguf_file="q4x-f32.gguf").eval()(
            input_ids=ids).logits
    assert (merged - expected).abs().max() < 1e-5, (merged - expected).abs().max()
    assert (from_gguf - merged).abs().max() < 1e-4, (from_gguf - merged).abs().max()
    assert "quantization_config" not in json.loads((dest / "merged" / "config.json").read_text())

    card = (dest / "README.md").read_text()
    assert "**Trained on a quantised base**" in card and "4-bit NF4 (double quantisation, bitsandbytes)" in card
    adapter = json.loads((dest / "peft" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(tiny_model_dir) and adapter["use_dora"] is True
    snippet = re.search(r"```python\n(from peft import PeftModel.*?)```", card, re.S).group(1)
    assert "quantization_config=quantised" in snippet
    env = {k: v for k, v in os.environ.items() if k not in ("LODGER_HOME", "PYTHONPATH")}
    ran = subprocess.run([sys.executable, "-c", "import sys; sys.modules['lodger'] = None\n" + snippet], cwd=dest,
                         env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]


def test_grpo_on_a_4bit_base_killed_in_the_middle_of_generation_resumes_bitwise(tiny_model_dir, tmp_path):
    """GRPO samples with the model in eval mode without gradients: on a 4-bit base that must run the
    same fp32 path as training (quant.keep_training_numerics), so the killed and resumed run samples
    the same completions and ends with the same adapter."""
    from fixtures_lib import VOWEL_REWARD
    from test_grpo import GRPO, JOB, grpo_job
    from test_preference import records

    reward = tmp_path / "rewards.py"
    reward.write_text(VOWEL_REWARD)
    job = grpo_job(tmp_path, tiny_model_dir, reward)
    job.write_text(job.read_text().replace('objective = "grpo"', 'objective = "grpo"\nbase_bits = 4'))
    assert GRPO["num_iterations"] == 2 and JOB["every_steps"] == 3
    _, straight = _run(job, tmp_path / "straight")
    env = lodger_env(tmp_path / "killed")
    killed = run_lodger(["run", job, "--quiet"], {**env, "LODGER_FAULT": "decode_step@30"})
    assert killed_by_sigkill(killed.returncode), describe(killed)
    run_id = killed.stdout.splitlines()[0].split()[1]
    resumed = run_lodger(["resume", run_id], env)
    assert resumed.returncode == 0, describe(resumed)
    folder = run_dir_of(run_id, env)
    assert records(folder) == records(straight)
    assert final_adapter_bytes(folder) == final_adapter_bytes(straight)
    assert json.loads((folder / "checkpoints" / checkpoint_dirs(folder)[-1] / "state.json").read_text())["base"]["bits"] == 4
