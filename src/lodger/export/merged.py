"""The run's trainable weights applied to the base: one plain model, and a standard transformers
folder (config, safetensors shards, tokenizer, generation config) that loads without lodger."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..model import TOKENIZER_FILES


def merged_model(base_folder: Path, method, weights: Path):
    """The base with the run's final weights merged in, fp32, in eval mode, with its KV cache on."""
    from safetensors.torch import load_file

    from ..model import attach_method, load_base_model, load_trainable_state, quiet_transformers

    quiet_transformers()
    method = method.model_copy(update={"init_adapter": None})  # the final weights replace it anyway
    model = load_base_model(base_folder)
    tensors = load_file(str(weights))
    if method.kind == "lora":
        model = attach_method(model, method, seed=0)
        load_trainable_state(model, method, tensors)
        model = model.merge_and_unload()
    else:
        load_trainable_state(model, method, tensors)
    model.config.use_cache = True
    return model.eval()


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
