"""The adapter as a stranger loads it: peft's files, with the base named as the world knows it (hub
id and revision, or the folder the user gave; never lodger's cache), plus the tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .merged import copy_tokenizer


def write_peft(weights: Path, base, dest: Path) -> None:
    """Copy the run's final adapter into ``dest`` and point its config at the base."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(weights, dest / "adapter_model.safetensors")
    config = json.loads((weights.parent / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = base.name_or_path
    config["revision"] = base.revision
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    copy_tokenizer(base.folder, dest)
