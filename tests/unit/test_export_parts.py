"""Pieces of `lodger export` on their own: the Modelfile (checked with the port of Ollama's grammar),
what the adapter names as its base in each mode, the files a shipped base carries, the hashes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from fixtures_lib import build_tiny_tokenizer
from modelfile_grammar import create_request, parse_file, render_template

LLAMA3 = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
          "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML_NO_SYSTEM = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_NO_NEWLINE = CHATML_NO_SYSTEM.replace("<|im_end|>\n'", "<|im_end|>'")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _modelfile(tokenizer, template: str | None = None, tmp: Path | None = None):
    from lodger.export.modelfile import modelfile

    if template is not None:
        tokenizer = build_tiny_tokenizer()
        tokenizer.chat_template = template
    text, info = modelfile("m-f16.gguf", "m", tokenizer)
    return parse_file(text), info, tokenizer


def test_a_chatml_modelfile_has_from_template_system_and_stop_lines_that_render_as_the_jinja_template(tokenizer,
                                                                                                       tmp_path):
    commands, info, tokenizer = _modelfile(tokenizer)
    (tmp_path / "m-f16.gguf").write_bytes(b"GGUF")
    request = create_request(commands, tmp_path)
    assert request.files == [tmp_path / "m-f16.gguf"]
    assert info == {"template": "chatml", "system": "You are a helpful assistant.",
                    "stop": ["<|im_end|>", "<|im_start|>"]}
    assert request.system == info["system"] and request.parameters == {"stop": info["stop"]}
    for messages in ([{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "x"}, {"role": "user", "content": "a"},
                      {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]):
        expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert render_template(request.template, messages, request.system) == expected


def test_a_chatml_template_without_a_default_system_prompt_gets_no_system_line(tokenizer):
    commands, info, _ = _modelfile(tokenizer, CHATML_NO_SYSTEM)
    assert info["template"] == "chatml" and info["system"] is None
    assert "system" not in [c.name for c in commands] and "template" in [c.name for c in commands]


@pytest.mark.parametrize("template", [CHATML_NO_NEWLINE, LLAMA3], ids=["chatml-variant", "llama3"])
def test_a_template_ollamas_chatml_would_not_reproduce_gets_no_template_line_but_still_stops_at_eos(tokenizer,
                                                                                                  template):
    commands, info, _ = _modelfile(tokenizer, template)
    names = [c.name for c in commands]
    assert info["template"] is None and "template" not in names and "system" not in names
    assert [c.args for c in commands if c.name == "stop"] == ["<|im_end|>"]  # the tokenizer's eos


def _base(tmp_path: Path, **kwargs):
    from lodger.export.base import Base
    from lodger.model import ModelSource

    folder = tmp_path / "folder"
    folder.mkdir(exist_ok=True)
    source = ModelSource("spec", "hf", folder, "0" * 64)
    return Base(source, folder, kwargs.pop("name", "org/name"), **kwargs)


def test_the_adapter_names_the_shipped_folder_the_gguf_file_or_the_base_it_was_trained_against(tmp_path):
    gguf = {"file": "m.Q4_1.gguf", "path": "/models/m.Q4_1.gguf", "quantisation": "Q4_1"}
    assert _base(tmp_path, revision="abc", ship=True).adapter_base == "./base"
    assert _base(tmp_path, revision="abc", ship=True).adapter_revision is None
    assert _base(tmp_path, gguf=gguf).adapter_base == "/models/m.Q4_1.gguf"  # never the hub id it came from
    named = _base(tmp_path, revision="abc")
    assert (named.adapter_base, named.adapter_revision) == ("org/name", "abc")
    assert "**Shipped**" in _base(tmp_path, ship=True).where("peft")
    assert "**Named, not shipped**" in named.where(".")


def test_a_shipped_base_carries_config_weights_and_tokenizer_and_refuses_a_folder_without_safetensors(tmp_path):
    from lodger.errors import ExportError

    base = _base(tmp_path, ship=True)
    for name in ("config.json", "tokenizer.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                 "lodger-cache.json", "pytorch_model.bin"):
        (base.folder / name).write_text("{}")
    assert sorted(p.name for p in base.shipped_files()) == [
        "config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json"]
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (base.folder / name).unlink()
    with pytest.raises(ExportError, match="no safetensors weights to ship; use --base name"):
        base.shipped_files()


def test_an_unknown_base_mode_is_refused_with_the_choices():
    from lodger.errors import ExportError
    from lodger.export.base import describe_base

    with pytest.raises(ExportError, match="--base 'copy': use one of auto, ship, name"):
        describe_base({"source": "x"}, "copy")


def test_file_hashes_are_taken_once_and_taken_again_for_a_file_whose_size_changed(tmp_path):
    from lodger.export.manifest import file_hashes

    (tmp_path / "a").write_bytes(b"one")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"two")
    first = file_hashes(tmp_path)
    assert first["sub/b"] == {"bytes": 3, "sha256": hashlib.sha256(b"two").hexdigest()}
    known = {**first, "a": {"bytes": 3, "sha256": "kept"}}
    (tmp_path / "sub" / "b").write_bytes(b"three")
    again = file_hashes(tmp_path, known)
    assert again["a"]["sha256"] == "kept" and again["sub/b"]["sha256"] == hashlib.sha256(b"three").hexdigest()
