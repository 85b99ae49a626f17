"""The merged model as one GGUF file for llama.cpp, Ollama and LM Studio, written with the `gguf`
package's own writer and tensor-name tables, as llama.cpp's convert_hf_to_gguf.py does it.

Architecture metadata comes from the model's config; the tokenizer from the source GGUF's fields
when the base was a GGUF file, else from the tokenizer files (byte-level BPE only)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ExportError

OUTTYPES = ("f32", "f16", "q8_0")
SUPPORTED = {"llama": "LLAMA"}
"""transformers model_type -> gguf.MODEL_ARCH member. Llama only for now: each architecture has
its own metadata and tensor layout (llama permutes q/k), and only what is tested is offered."""
# Source GGUF fields that describe the file, not the model: the new file writes its own.
_NOT_COPIED = ("general.file_type", "general.quantization_version", "general.name", "general.alignment",
               "general.architecture")


def check_supported(config: dict, outtype: str) -> None:
    """Refuse, before anything is written, what this writer cannot turn into a correct GGUF."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise ExportError(f"--format gguf: architecture `{model_type}` is not supported (supported: "
                          f"{', '.join(SUPPORTED)}); export `--format merged` and convert it with llama.cpp's "
                          "convert_hf_to_gguf.py")
    if outtype not in OUTTYPES:
        raise ExportError(f"--outtype {outtype!r}: use one of {', '.join(OUTTYPES)}")
    rope = config.get("rope_scaling") or {}
    params = config.get("rope_parameters") or {}
    kind = rope.get("rope_type") or rope.get("type") or params.get("rope_type") or "default"
    if kind != "default":
        raise ExportError(f"--format gguf: rope scaling `{kind}` is not supported by lodger's GGUF writer; "
                          "export `--format merged` and convert it with llama.cpp's convert_hf_to_gguf.py")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ExportError(f"--format gguf: `{key} = true` in the model config is not supported; export "
                              "`--format merged` and convert it with llama.cpp")


def _permute(weights, n_head: int, n_head_kv: int | None):
    """llama.cpp's q/k row order (interleaved rotary halves), as convert_hf_to_gguf.py's LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _tensor_data(name: str, array, outtype: str):
    """(data, raw_dtype) in the outtype; vectors stay f32 and Q8_0 needs rows in blocks of 32, as in llama.cpp."""
    import gguf
    import numpy as np

    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.ndim < 2 or outtype == "f32":
        return array, None
    if outtype == "q8_0" and array.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
        return gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    return array.astype(np.float16), None


def _arch_metadata(writer, config: dict) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    params = config.get("rope_parameters") or {}
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_freq_base(float(params.get("rope_theta") or config.get("rope_theta") or 10000.0))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config["hidden_size"] // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def _copy_fields(writer, source_gguf: Path) -> None:
    """The source GGUF's tokenizer and descriptive fields, value for value and type for type."""
    import gguf

    reader = gguf.GGUFReader(str(source_gguf))
    for key, fld in reader.fields.items():
        if key.startswith("GGUF.") or key in _NOT_COPIED or not (key.startswith(("tokenizer.", "general."))):
            continue
        main = gguf.GGUFValueType(fld.types[0])
        if main == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, fld.contents(), main, sub_type=gguf.GGUFValueType(fld.types[-1]))
        else:
            writer.add_key_value(key, fld.contents(), main)


def _tokenizer_from_files(writer, folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer's vocabulary, merges and special tokens, as llama.cpp's
    get_vocab_base() and gguf.SpecialVocab read them."""
    import gguf
    from transformers import AutoTokenizer

    data = json.loads((folder / "tokenizer.json").read_text()) if (folder / "tokenizer.json").is_file() else {}
    if data.get("model", {}).get("type") != "BPE" or "ByteLevel" not in json.dumps(data.get("decoder")):
        raise ExportError("--format gguf: only byte-level BPE tokenizers (tokenizer.json) can be written from "
                          "tokenizer files; export `--format merged` and convert it with llama.cpp")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    special = set(tokenizer.all_special_tokens)
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if token in special or (token in added and token.startswith("<|"))
                         else gguf.TokenType.USER_DEFINED if token in added else gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")  # llama.cpp's default split; exact pre-tokenisers need llama.cpp's hash table
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special_vocab = gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens))
    special_vocab.add_to_gguf(writer, quiet=True)
    if tokenizer.chat_template and not special_vocab.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def write_gguf(model, path: Path, *, outtype: str, name: str, tokenizer_folder: Path,
               source_gguf: Path | None, base_name: str) -> dict:
    """Write the merged ``model`` to ``path``; returns {"tensors": n, "outtype": ..., "architecture": ...}."""
    import gguf

    config = model.config.to_dict()
    check_supported(config, outtype)
    arch = getattr(gguf.MODEL_ARCH, SUPPORTED[config["model_type"]])
    n_blocks = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, n_blocks)
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # llama.cpp reuses token_embd when output.weight is absent
    mapped = {}
    for hf_name, tensor in state.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        new = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ExportError(f"--format gguf: tensor `{hf_name}` has no name in gguf's {arch.name} table")
        mapped[new] = (hf_name, tensor)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(name)
    if source_gguf is not None:
        _copy_fields(writer, source_gguf)
    else:
        _tokenizer_from_files(writer, tokenizer_folder, config["vocab_size"])
    writer.add_base_model_count(1)
    writer.add_base_model_name(0, base_name)
    _arch_metadata(writer, config)
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    writer.add_file_type(file_type)
    if outtype == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for new, (hf_name, tensor) in mapped.items():
        array = tensor.detach().float().cpu().numpy()
        if hf_name.endswith("q_proj.weight"):
            array = _permute(array, heads, heads)
        elif hf_name.endswith("k_proj.weight"):
            array = _permute(array, heads, kv_heads)
        data, raw = _tensor_data(new, array, outtype)
        writer.add_tensor(new, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"tensors": len(mapped), "outtype": outtype, "architecture": gguf.MODEL_ARCH_NAMES[arch]}
