"""`lodger export` in the formats people run: a peft adapter a stranger can load, a merged
transformers folder, a GGUF file for llama.cpp / Ollama. Each is checked against lodger's own model
with the adapter, in the real CLI, on the tiny Llama (SmolLM2 in test_export_slow.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import describe, lodger_env, run_lodger

IDS = [[1, 10, 50, 100, 200, 300, 2, 5, 7, 42, 17, 250]]


@pytest.fixture
def home_with_baseline(baseline, lodger_home) -> tuple[dict, str]:
    """The baseline's home copied into this test's (an export writes an `exported` event)."""
    shutil.copytree(baseline.home, lodger_home, dirs_exist_ok=True)
    return lodger_env(lodger_home), baseline.run_id


@pytest.fixture(scope="module")
def torch1():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch
    torch.set_num_threads(threads)


def lodger_logits(torch, run_dir: Path, model_dir: Path):
    """lodger's own model with the run's final adapter (not merged)."""
    from safetensors.torch import load_file

    from lodger.lifecycle.jobfile import load_job
    from lodger.model import attach_method, load_base_model, load_trainable_state

    job = load_job(run_dir / "job.toml")
    model = attach_method(load_base_model(model_dir), job.method, job.training.seed)
    load_trainable_state(model, job.method, load_file(run_dir / "adapter" / "adapter_model.safetensors"))
    return logits(torch, model)


def logits(torch, model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS), use_cache=False).logits


def greedy(torch, model, n: int = 12):
    with torch.no_grad():
        ids = torch.tensor(IDS)
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=2)[0, ids.shape[1]:].tolist()


def test_merged_and_f32_gguf_equal_lodgers_model_the_manifest_holds_and_a_copy_loads_by_its_card(
        home_with_baseline, tiny_model_dir, tmp_path, torch1):
    torch = torch1
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    env, run_id = home_with_baseline
    dest = tmp_path / "out"
    result = run_lodger(["export", run_id, dest, "--format", "peft", "--format", "merged,gguf",
                         "--outtype", "f32"], env)
    assert result.returncode == 0, describe(result)
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        ["peft", "merged", "gguf", "README.md", "MANIFEST.json", "job.toml", "provenance.json", "metrics.jsonl",
         "events.json"])
    ours = lodger_logits(torch, Path(env["LODGER_HOME"]) / "runs" / run_id, tiny_model_dir)

    merged = AutoModelForCausalLM.from_pretrained(dest / "merged")
    assert merged.dtype == torch.float32
    from_merged = logits(torch, merged)
    base = logits(torch, AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert not torch.allclose(from_merged, base, atol=1e-4), "the merge must change the model"
    assert torch.allclose(from_merged, ours, atol=1e-5, rtol=0), (from_merged - ours).abs().max()
    tokenizer = AutoTokenizer.from_pretrained(dest / "merged")
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(tiny_model_dir).chat_template

    name = "e2e-f32.gguf"
    reader = gguf.GGUFReader(str(dest / "gguf" / name))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert field("general.architecture") == "llama" and field("general.name") == "e2e"
    assert field("llama.block_count") == config["num_hidden_layers"]
    assert field("llama.attention.head_count_kv") == config["num_key_value_heads"]
    assert field("llama.embedding_length") == config["hidden_size"]
    assert field("general.file_type") == gguf.LlamaFileType.ALL_F32
    assert len(field("tokenizer.ggml.tokens")) == config["vocab_size"]
    assert field("tokenizer.ggml.eos_token_id") == config["eos_token_id"]
    assert field("tokenizer.chat_template") == tokenizer.chat_template
    names = {t.name for t in reader.tensors}
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{part}.weight" for i in range(config["num_hidden_layers"])
        for part in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                     "ffn_down")}
    assert names == expected  # tied embeddings: no output.weight
    assert {t.tensor_type.name for t in reader.tensors} == {"F32"}

    from_gguf = AutoModelForCausalLM.from_pretrained(dest / "gguf", gguf_file=name)
    assert torch.allclose(logits(torch, from_gguf), from_merged, atol=1e-6, rtol=0)
    assert greedy(torch, from_gguf) == greedy(torch, merged)

    modelfile = (dest / "gguf" / "Modelfile").read_text()
    assert f"FROM ./{name}" in modelfile and "<|im_start|>" in modelfile and "ollama create e2e" in modelfile

    from lodger.export.manifest import verify_manifest
    from lodger.ledger import Ledger

    manifest = json.loads((dest / "MANIFEST.json").read_text())
    assert verify_manifest(dest) == []
    assert {"peft/adapter_model.safetensors", "merged/config.json", f"gguf/{name}", "README.md"} <= set(manifest["files"])
    with Ledger() as ledger:
        events = ledger.events()
    exported = [e for e in events if e["kind"] == "exported"]
    assert len(exported) == 1
    before = [e for e in events if e["seq"] < exported[0]["seq"]][-1]
    assert manifest["ledger_head"]["hash"] == before["hash"] and manifest["ledger_head"]["seq"] == before["seq"]
    card = (dest / "README.md").read_text()
    assert "None" not in card and "llama-cli -m gguf/" in card and "ollama create" in card
    the_copy_loads_by_its_model_card_alone(torch, dest, tmp_path / "elsewhere" / "copy", tiny_model_dir, env, ours)


@pytest.mark.parametrize("outtype,matrix_type,tolerance", [("f16", "F16", 2e-3), ("q8_0", "Q8_0", 3e-2)])
def test_quantised_gguf_is_within_its_outtypes_tolerance(home_with_baseline, tiny_model_dir, tmp_path, torch1,
                                                         outtype, matrix_type, tolerance):
    torch = torch1
    import gguf
    from transformers import AutoModelForCausalLM

    env, run_id = home_with_baseline
    dest = tmp_path / "out"
    result = run_lodger(["export", run_id, dest, "--format", "gguf", "--outtype", outtype], env)
    assert result.returncode == 0, describe(result)
    name = f"e2e-{outtype}.gguf"
    reader = gguf.GGUFReader(str(dest / name))
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.attn_q.weight"] == matrix_type and kinds["token_embd.weight"] == matrix_type
    assert kinds["blk.0.attn_norm.weight"] == "F32"  # vectors stay f32, as llama.cpp keeps them
    ours = lodger_logits(torch, Path(env["LODGER_HOME"]) / "runs" / run_id, tiny_model_dir)
    theirs = logits(torch, AutoModelForCausalLM.from_pretrained(dest, gguf_file=name))
    difference = (theirs - ours).abs().max().item()
    assert difference <= tolerance * ours.abs().max().item(), difference


# What the snippets are run with: lodger cannot be imported, $LODGER_HOME does not exist.
GUARD = "import sys\nsys.modules['lodger'] = None  # any `import lodger` fails\n"
DUMP = ("\nimport json, torch\nwith torch.no_grad():\n"
        f"    logits = model(input_ids=torch.tensor({IDS})).logits\n"
        "json.dump(logits.tolist(), open('logits.json', 'w'))\n"
        "assert not [m for m in sys.modules if m.startswith('lodger') and sys.modules[m] is not None]\n")


def run_snippet(code: str, cwd: Path, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a model card's snippet as a stranger would: no lodger, no $LODGER_HOME, a fresh HF_HOME, offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LODGER", "PYTHONPATH", "HF_", "TRANSFORMERS_"))}
    env.update({"LODGER_HOME": str(cwd / "no-such-home"), "HF_HOME": str(cwd / "fresh-hf-home"),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(extra_env or {})})
    return subprocess.run([sys.executable, "-c", GUARD + code + DUMP], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def card_snippets(card: str, runtime: str = "transformers") -> dict[str, str]:
    """The card's Python blocks for ``runtime`` (the heading above each starts with it), by heading."""
    blocks = re.findall(r"### ([^\n]+)\n(?:(?!###).)*?```python\n(.*?)```", card, re.S)
    return {heading: code for heading, code in blocks if heading.startswith(runtime)}


def the_copy_loads_by_its_model_card_alone(torch, dest: Path, fresh: Path, tiny_model_dir: Path, env: dict,
                                           ours) -> None:
    """An export copied to a fresh folder (and the original gone) loads by its card's snippets alone, as a
    stranger runs them: no lodger, no $LODGER_HOME. (Part of the test above: one export serves both.)"""
    shutil.copytree(dest, fresh)
    shutil.rmtree(dest)
    card = (fresh / "README.md").read_text()
    adapter = json.loads((fresh / "peft" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(tiny_model_dir.resolve())  # named: --base auto, a folder
    assert not (fresh / "peft" / "base").exists() and "**Named, not shipped**" in card
    assert str(env["LODGER_HOME"]) not in json.dumps(adapter)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in (fresh / "peft").iterdir()}
    snippets = card_snippets(card)
    assert len(snippets) == 2, card
    for heading, code in snippets.items():
        done = run_snippet(code, fresh)
        assert done.returncode == 0, f"{heading}\n{code}\n{done.stderr[-3000:]}"
        assert done.stdout.endswith("\n"), "the snippet prints the model's reply (a random model's may be blank)"
        theirs = torch.tensor(json.loads((fresh / "logits.json").read_text()))
        assert torch.allclose(theirs, ours, atol=1e-5, rtol=0), (heading, (theirs - ours).abs().max())


def test_export_refuses_a_non_empty_folder_or_a_file_and_leaves_nothing_behind(home_with_baseline, tmp_path):
    env, run_id = home_with_baseline
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    for dest, words in ((full, "not empty"), (a_file, "existing file")):
        result = run_lodger(["export", run_id, dest, "--format", "merged"], env)
        assert result.returncode == 2, describe(result)
        assert words in result.stderr and "Traceback" not in result.stderr, describe(result)
    assert sorted(p.name for p in full.iterdir()) == ["keep.txt"] and a_file.read_text() == "mine"
    bad = run_lodger(["export", run_id, tmp_path / "new", "--format", "onnx"], env)
    assert bad.returncode == 2 and "unknown format" in bad.stderr and "Traceback" not in bad.stderr, describe(bad)
    assert not (tmp_path / "new").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_gguf_refuses_an_unsupported_architecture_before_writing_anything():
    from lodger.errors import ExportError
    from lodger.export.gguf import check_supported

    with pytest.raises(ExportError, match="architecture `gpt2` is not supported"):
        check_supported({"model_type": "gpt2"}, "f16")
    with pytest.raises(ExportError, match="rope scaling `llama3`"):
        check_supported({"model_type": "llama", "rope_parameters": {"rope_type": "llama3"}}, "f16")
