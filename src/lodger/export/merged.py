"""The run's trainable weights applied to the base: one plain model, and a standard transformers
folder (config, safetensors shards, tokenizer, generation config) that loads without lodger."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..model import TOKENIZER_FILES


def merged_model(base_folder: Path, method, weights: Path, quantisation: dict | None = None):
    """The base with the run's final weights merged in, fp32, in eval mode, with its KV cache on. A
    base trained on quantised ([method] base_bits) is quantised again, checked against the run's
    record of it (``quantisation``: provenance's sha256), and dequantised to fp32 before the merge:
    the weights the adapter was trained against, not the unquantised original."""
    from safetensors.torch import load_file

    from ..model import attach_method, load_base_model, load_trainable_state, quiet_transformers

    quiet_transformers()
    method = method.model_copy(update={"init_adapter": None})  # the final weights replace it anyway
    model = load_base_model(base_folder, method)
    if getattr(method, "base_bits", None) is not None:
        model = dequantised(model, method.base_bits, quantisation)
    tensors = load_file(str(weights))
    if method.kind == "lora":
        model = attach_method(model, method, seed=0)
        load_trainable_state(model, method, tensors)
        model = model.merge_and_unload()
    else:
        load_trainable_state(model, method, tensors)
    model.config.use_cache = True
    return model.eval()


def dequantised(model, bits: int, quantisation: dict | None):
    """A quantised base as fp32 linear layers holding exactly the values its layers computed with
    in training, after checking its quantised tensors are the ones the run recorded."""
    import torch

    from ..errors import RunStateError
    from ..quant import base_digest

    recorded = (quantisation or {}).get("sha256")
    now = base_digest(model)
    if recorded != now:
        raise RunStateError(f"the {bits}-bit base quantises to sha256 {now[:16]} here, the run recorded "
                            f"{str(recorded)[:16]} ({(quantisation or {}).get('library')} "
                            f"{(quantisation or {}).get('version')}); export with that library version")
    model = model.dequantize(dtype=torch.float32)
    model.config.use_cache = False
    return model


def copy_tokenizer(base_folder: Path, dest: Path) -> list[str]:
    """The base's tokenizer files (and chat template) beside the weights."""
    copied = []
    for name in TOKENIZER_FILES:
        if (base_folder / name).is_file():
            shutil.copyfile(base_folder / name, dest / name)
            copied.append(name)
    return copied


def write_merged(model, base_folder: Path, dest: Path, max_shard_size: str = "2GB") -> None:
    """Save the merged model as a transformers folder.

    The model was built from a plain safetensors folder (a GGUF base is dequantised into lodger's
    cache first), so ``save_pretrained`` works; on a model loaded straight from GGUF it would
    refuse ("not serializable")."""
    dest.mkdir(parents=True, exist_ok=True)
    model.config._name_or_path = ""  # never a path into lodger's cache
    model.save_pretrained(str(dest), max_shard_size=max_shard_size, safe_serialization=True)
    if not (dest / "generation_config.json").is_file() and (base_folder / "generation_config.json").is_file():
        shutil.copyfile(base_folder / "generation_config.json", dest / "generation_config.json")
    copy_tokenizer(base_folder, dest)
