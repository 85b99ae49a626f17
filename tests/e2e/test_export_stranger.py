"""An export as a stranger meets it, on the tiny Llama: with lodger's cache hidden, a fresh HF_HOME
and HF_HUB_OFFLINE=1, a process that imports only peft and transformers (stranger.py) loads (a) the
adapter on the base the export ships, (b) merged/ with its tokenizer and chat template, and (c)
llama.cpp runs the GGUF (node-llama-cpp's prebuilt build under Node, stranger_llama.mjs), and all of
them compute what lodger's own model computes; (d) the Modelfile parses by Ollama's grammar
(tests/modelfile_grammar.py) with FROM, a TEMPLATE that renders as the chat template, and PARAMETER
stop lines; the card lists every file's sha256 and the chat template's. A run trained on a tiny GGUF
file ships its dequantised base by default and names no hub id. SmolLM2 does (a)-(d) in
test_export_slow.py.

Comparing runtimes on a random tiny model: logits are compared at every position of the prompt and
along the greedy path (f32 on both sides, f32 KV cache in llama.cpp: they agree to about 1e-7, the
tolerance is 1e-4), and greedy tokens must be equal except from a step where transformers' two best
logits are closer than twice that tolerance, a near tie that either runtime may break either way
(`agree_up_to_ties`)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import describe, lodger_env, run_lodger

STRANGER = Path(__file__).with_name("stranger.py")
MESSAGES = [{"role": "user", "content": "Reverse the words: red blue cat"}]
"""No digits: the tiny tokenizer splits digits one by one, which llama.cpp's `default` pre-tokeniser
does not (docs/export.md); the words and the special tokens tokenise alike."""
ATOL = 1e-4
LLAMA_CPP = Path(__file__).parents[1] / "node-llama-cpp"
"""node-llama-cpp and its prebuilt CPU build of llama.cpp, installed here by `make test` (`npm ci`, from
the lock file beside it: about 8 s and 85 MB); stranger_llama.mjs runs them under Node."""
LLAMA_CPP_PYTHON = importlib.util.find_spec("llama_cpp") is not None
NO_LLAMA_CPP_PYTHON = ("llama-cpp-python, which the card's snippet imports, is not installed (`make gguf-runtime` "
                       "compiles it: about 3-7 minutes on 2 cores)")


@pytest.fixture(scope="module")
def export(baseline, tmp_path_factory):
    """The baseline exported once for this module: peft (base shipped), merged and an f32 GGUF."""
    home = tmp_path_factory.mktemp("stranger_home")
    shutil.copytree(baseline.home, home, dirs_exist_ok=True)
    env = lodger_env(home)
    dest = tmp_path_factory.mktemp("stranger_export") / "out"
    result = run_lodger(["export", baseline.run_id, dest, "--format", "peft,merged,gguf", "--outtype", "f32",
                         "--base", "ship"], env)
    assert result.returncode == 0, describe(result)
    return SimpleNamespace(home=home, env=env, dest=dest, run_id=baseline.run_id, gguf="e2e-f32.gguf")


@contextlib.contextmanager
def lodger_cache_hidden(home: Path):
    """$LODGER_HOME/cache moved out of reach while a stranger runs (the dequantised GGUF bases live there)."""
    cache, hidden = home / "cache", home.parent / f".{home.name}-cache-hidden"
    moved = cache.is_dir()
    if moved:
        os.rename(cache, hidden)
    try:
        yield
    finally:
        if moved:
            os.rename(hidden, cache)


def strangers_env(tmp: Path) -> dict[str, str]:
    """No lodger variables or source path, a fresh empty HF_HOME, offline."""
    fresh = tmp / "fresh-hf-home"
    fresh.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LODGER", "PYTHONPATH", "HF_", "TRANSFORMERS_"))}
    env.update({"HF_HOME": str(fresh), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "LODGER_HOME": str(tmp / "no-such-home")})
    return env


def run_stranger(args: list[str], cwd: Path, home: Path, ids, messages=MESSAGES, new_tokens: int = 12,
                 threads: int = 1) -> dict:
    if "--gguf" in args:
        assert (LLAMA_CPP / "node_modules" / "@node-llama-cpp" / "linux-x64").is_dir(), \
            f"llama.cpp is not installed in {LLAMA_CPP}: `make test` installs it (npm ci --prefix {LLAMA_CPP})"
        args = [*args, "--llama-cpp", str(LLAMA_CPP)]
    with lodger_cache_hidden(home):
        done = subprocess.run([sys.executable, str(STRANGER), *args, "--ids", json.dumps(ids), "--messages",
                               json.dumps(messages), "--new-tokens", str(new_tokens), "--threads", str(threads)],
                              cwd=cwd, env=strangers_env(cwd), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout)
    assert out["lodger_imported"] == []
    assert not list((cwd / "fresh-hf-home").rglob("*.safetensors")), "nothing may come from a hub cache"
    return out


def agree_up_to_ties(theirs: list[int], ours: list[int], our_logits: list[list[float]], tie: float) -> int:
    """``theirs == ours``, or they part at a step where our two best logits are within ``tie``; returns
    how many leading tokens agree."""
    for i, (a, b) in enumerate(zip(theirs, ours)):
        if a != b:
            second, first = sorted(our_logits[i])[-2:]
            assert first - second <= tie, f"step {i}: {a} vs {b}, though our margin is {first - second}"
            return i
    assert len(theirs) == len(ours)
    return len(ours)


def dense(rows: list[dict[str, float]], n_vocab: int):
    """llama.cpp's ``{token id: logit}`` rows as an array, NaN where a token was not reported."""
    import numpy as np

    out = np.full((len(rows), n_vocab), np.nan)
    for i, row in enumerate(rows):
        for token, value in row.items():
            out[i, int(token)] = value
    return out


def copy_of(export, tmp_path: Path) -> Path:
    """The export copied to a fresh folder, as a stranger receives it."""
    fresh = tmp_path / "received"
    shutil.copytree(export.dest, fresh)
    return fresh


def test_a_stranger_loads_the_shipped_base_adapter_and_merged_folder_offline_and_they_equal_lodgers_model(
        export, tiny_model_dir, tmp_path):
    import torch

    from test_export import IDS, lodger_logits

    fresh = copy_of(export, tmp_path)
    config = json.loads((fresh / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "./base" and config["revision"] is None
    shipped = fresh / "peft" / "base"
    assert (shipped / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    out = run_stranger(["--peft", "peft", "--merged", "merged"], fresh, export.home, IDS[0])
    assert Path(out["peft"]["base_path"]) == shipped.resolve()

    torch.set_num_threads(1)
    ours = lodger_logits(torch, export.home / "runs" / export.run_id, tiny_model_dir)
    for name in ("peft", "merged"):
        theirs = torch.tensor(out[name]["logits"])
        assert torch.allclose(theirs, ours[0], atol=1e-5, rtol=0), (name, (theirs - ours[0]).abs().max())
    from fixtures_lib import CHAT_TEMPLATE

    merged = out["merged"]
    assert merged["chat_template"] == CHAT_TEMPLATE
    assert merged["prompt"] == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                                "Reverse the words: red blue cat<|im_end|>\n<|im_start|>assistant\n")


def test_llama_cpp_loads_the_gguf_tokenises_the_prompt_alike_and_its_greedy_tokens_match_the_merged_model(
        export, tmp_path):
    from test_export import IDS

    fresh = copy_of(export, tmp_path)
    out = run_stranger(["--merged", "merged", "--gguf", f"gguf/{export.gguf}", "--prompt-logits"], fresh,
                       export.home, IDS[0], new_tokens=16)
    merged, llama = out["merged"], out["llama"]
    assert llama["runtime"]["build"] == "prebuilt", llama["runtime"]
    assert llama["metadata"]["general.architecture"] == "llama"
    assert llama["metadata"]["tokenizer.chat_template"] == merged["chat_template"]
    assert llama["prompt_tokens"] == merged["prompt_ids"]
    agreed = agree_up_to_ties(llama["greedy"], merged["greedy"], merged["greedy_logits"], 2 * ATOL)
    import numpy as np

    n_vocab = len(merged["greedy_logits"][0])
    theirs, ours = dense(llama["greedy_logits"][:agreed + 1], n_vocab), np.array(merged["greedy_logits"][:agreed + 1])
    assert np.abs(theirs - ours).max() <= ATOL, np.abs(theirs - ours).max()  # NaN (a token missing) fails too
    assert agreed == 16, "on this model the runtimes agree on every greedy token; a tie here is news"
    # the trained tiny model repeats one token greedily: the prompt's positions are where it varies
    theirs, ours = dense(llama["prompt_logits"], n_vocab), np.array(merged["prompt_logits"])
    assert ours.shape == (len(merged["prompt_ids"]), n_vocab)
    assert np.abs(theirs - ours).max() <= ATOL, np.abs(theirs - ours).max()
    assert len(set(ours.argmax(axis=1))) > 3, "the prompt's positions must not all predict alike"


@pytest.mark.skipif(not LLAMA_CPP_PYTHON, reason=NO_LLAMA_CPP_PYTHON)
def test_the_cards_llama_cpp_python_snippet_runs_in_a_fresh_folder(export, tmp_path):
    from test_export import card_snippets

    fresh = copy_of(export, tmp_path)
    (snippet,) = card_snippets((fresh / "README.md").read_text(), "llama-cpp-python").values()
    with lodger_cache_hidden(export.home):
        done = subprocess.run([sys.executable, "-c", "import sys\nsys.modules['lodger'] = None\n" + snippet],
                              cwd=fresh, env=strangers_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.endswith("\n"), done.stderr[-3000:]


def test_the_modelfile_parses_by_ollamas_grammar_with_from_a_template_that_renders_as_the_chat_template_and_stops(
        export):
    from transformers import AutoTokenizer

    from modelfile_grammar import create_request, parse_file, render_template

    folder = export.dest / "gguf"
    commands = parse_file((folder / "Modelfile").read_bytes())
    names = [c.name for c in commands]
    assert names.count("model") == 1 and names.count("template") == 1 and names.count("system") == 1, names
    request = create_request(commands, folder)
    assert request.files == [folder / export.gguf] and request.from_name is None
    tokenizer = AutoTokenizer.from_pretrained(export.dest / "merged")
    assert tokenizer.eos_token == "<|im_end|>" and request.parameters["stop"] == ["<|im_end|>", "<|im_start|>"]
    assert request.system == "You are a helpful assistant."
    conversations = [MESSAGES,
                     [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky?"}],
                     [{"role": "user", "content": "Spell cat."}, {"role": "assistant", "content": "c-a-t"},
                      {"role": "user", "content": "And dog?"}, {"role": "assistant", "content": "d-o-g"},
                      {"role": "user", "content": "Line\nbreaks\n\nkept?"}]]
    for messages in conversations:
        expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert render_template(request.template, messages, request.system) == expected


def test_the_card_lists_every_files_sha256_and_the_chat_templates(export):
    import gguf

    dest = export.dest
    card = (dest / "README.md").read_text()
    rows = {rel: (int(size), sha) for rel, size, sha in
            re.findall(r"^\| `([^`]+)` \| (\d+) \| `([0-9a-f]{64})` \|$", card, re.M)}
    on_disk = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
    assert set(rows) == on_disk - {"README.md", "MANIFEST.json"}
    assert {"peft/base/model.safetensors", "peft/adapter_model.safetensors", f"gguf/{export.gguf}",
            "gguf/Modelfile", "merged/model.safetensors"} <= set(rows)
    manifest = json.loads((dest / "MANIFEST.json").read_text())
    for rel, (size, sha) in rows.items():
        data = (dest / rel).read_bytes()
        assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest()), rel
        assert manifest["files"][rel]["sha256"] == sha
    assert manifest["files"]["README.md"]["sha256"] == hashlib.sha256(card.encode()).hexdigest()

    (template_sha,) = re.findall(r"Chat template sha256 `([0-9a-f]{64})`", card)
    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(dest / "merged").chat_template
    in_gguf = gguf.GGUFReader(str(dest / "gguf" / export.gguf)).fields["tokenizer.chat_template"].contents()
    assert template_sha == hashlib.sha256(template.encode()).hexdigest() == hashlib.sha256(in_gguf.encode()).hexdigest()
    assert manifest["chat_template_sha256"] == template_sha and manifest["base"] == "shipped"
    assert "**Shipped**: `peft/base/`" in card and "None" not in card


def test_a_run_on_a_gguf_base_ships_the_dequantised_weights_it_trained_against_and_names_no_hub_id(
        e2e_data, tiny_model_dir, lodger_home, tmp_path):
    """The issue's own case on the tiny model: trained on a GGUF file (dequantised to fp32 in lodger's
    cache), the default export ships those weights; a stranger loads the adapter on them offline."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers import run_dir_of, write_job
    from lodger.export.gguf import write_gguf
    from lodger.model import model_folder, resolve_source
    from test_export import IDS, lodger_logits

    source = tmp_path / "models" / "tiny-f32.gguf"
    source.parent.mkdir()
    write_gguf(AutoModelForCausalLM.from_pretrained(tiny_model_dir), source, outtype="f32", name="tiny",
               tokenizer_folder=tiny_model_dir, source_gguf=None, base_name="tiny")
    env = lodger_env(lodger_home)
    job = write_job(tmp_path / "gguf.toml", model=source, train=e2e_data["train"], steps=2, every_steps=2,
                    eval_every=None, eval_fraction=0.0, dropout=0.0, name="from-gguf")
    result = run_lodger(["run", job, "--quiet"], env)
    assert result.returncode == 0, describe(result)
    run_id = result.stdout.splitlines()[0].split()[1]
    dest = tmp_path / "out"
    result = run_lodger(["export", run_id, dest], env)
    assert result.returncode == 0 and "base/ (the base's weights, shipped)" in result.stdout, describe(result)

    config = json.loads((dest / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "./base" and config["revision"] is None
    cache = model_folder(resolve_source(str(source)))
    assert (dest / "base" / "model.safetensors").read_bytes() == (cache / "model.safetensors").read_bytes()
    assert not (dest / "base" / "lodger-cache.json").exists()
    card = (dest / "README.md").read_text()
    assert "GGUF file `tiny-f32.gguf`" in card and "dequantised to float32" in card and "**Shipped**: `base/`" in card

    out = run_stranger(["--peft", "."], dest, lodger_home, IDS[0])
    torch.set_num_threads(1)
    ours = lodger_logits(torch, run_dir_of(run_id, env), cache)
    theirs = torch.tensor(out["peft"]["logits"])
    assert torch.allclose(theirs, ours[0], atol=1e-5, rtol=0), (theirs - ours[0]).abs().max()
