"""The adapter as a stranger loads it: peft's files with the tokenizer, and the base either shipped
beside it (``base/``: the weights exactly as trained against) or named where it is found offline
(hub id and revision, the GGUF file, or the folder the user gave; never lodger's cache)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .base import SHIPPED
from .merged import copy_tokenizer


def write_peft(weights: Path, base, dest: Path) -> None:
    """Copy the run's final adapter into ``dest``, point its config at the base, ship the base if asked."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(weights, dest / "adapter_model.safetensors")
    config = json.loads((weights.parent / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = base.adapter_base
    config["revision"] = base.adapter_revision
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    copy_tokenizer(base.folder, dest)
    if base.ship:
        (dest / SHIPPED).mkdir()
        for path in base.shipped_files():
            shutil.copyfile(path, dest / SHIPPED / path.name)
