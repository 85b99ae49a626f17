"""The base model of a run as the world knows it: the hub id where known, the exact weights it was
trained against (for a GGUF base: the file, its quantisation, and that it was dequantised), and
lines of Python that load those weights without lodger."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import RunStateError
from ..model import ALIAS_HUB_IDS, ALIASES, HUB_ID, ModelSource, model_folder, resolve_source


@dataclass
class Base:
    """What an export says about, and needs from, the run's base model."""

    source: ModelSource
    folder: Path                 # a Hugging Face folder with the weights trained against (cache for GGUF)
    name_or_path: str            # adapter_config's base_model_name_or_path: never a lodger cache path
    revision: str | None = None  # hub commit, where known
    gguf: dict | None = None     # {"file", "path", "quantisation"} when the base was a GGUF file
    facts: list[str] = field(default_factory=list)   # model card lines, exact and complete

    def load_lines(self) -> list[str]:
        """Python that loads the base weights the adapter was trained against (no lodger)."""
        if self.gguf:
            return [f"base = AutoModelForCausalLM.from_pretrained({str(Path(self.gguf['path']).parent)!r},",
                    f"                                            gguf_file={self.gguf['file']!r})"
                    "  # dequantised, as trained"]
        rev = f", revision={self.revision!r}" if self.revision else ""
        return [f"base = AutoModelForCausalLM.from_pretrained({self.name_or_path!r}{rev})"]


def gguf_quantisation(path: Path) -> str:
    """The quantisation of a GGUF file: its most common type among matrices (e.g. Q4_1)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    kinds = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    return kinds.most_common(1)[0][0] if kinds else "unknown"


def _folder_name(folder: Path, spec: str) -> str:
    """A folder's name as the world knows it: config's _name_or_path when it is a hub id, else the
    path the user gave."""
    try:
        named = json.loads((folder / "config.json").read_text()).get("_name_or_path") or ""
    except (OSError, ValueError):
        named = ""
    return named if HUB_ID.match(named) else spec


def describe_base(model_record: dict) -> Base:
    """Resolve the run's base again (nothing is downloaded) and check it is the one trained against."""
    spec = model_record["source"]
    source = resolve_source(spec)
    if source.sha256 != model_record.get("sha256"):
        raise RunStateError(f"the base model {spec!r} changed since the run (recorded sha256 "
                            f"{model_record.get('sha256')}, now {source.sha256}); restore it to export")
    folder = model_folder(source)
    sha = f"sha256 `{source.sha256}`"
    if source.kind == "gguf":
        quant = gguf_quantisation(source.path)
        hub = ALIAS_HUB_IDS.get(spec)
        base = Base(source, folder, hub or spec, None,
                    {"file": source.path.name, "path": str(source.path), "quantisation": quant})
        alias = f" (lodger alias `{spec}`, from the `{ALIASES[spec][0]}` wheel)" if spec in ALIASES else ""
        base.facts = [f"Trained against the GGUF file `{source.path.name}`{alias}, {sha}, quantised "
                      f"**{quant}**, dequantised to float32 for training."]
        if hub:
            base.facts.append(f"That file is a {quant} conversion of [`{hub}`](https://huggingface.co/{hub}); "
                              "the adapter was not trained against the original (unquantised) weights, so "
                              "on them it behaves close to, not exactly as, it did in training.")
        return base
    hub = source.hub
    if hub:
        base = Base(source, folder, hub["id"], hub["commit"])
        base.facts = [f"Trained against [`{hub['id']}`](https://huggingface.co/{hub['id']}) at commit "
                      f"`{hub['commit']}` (revision `{hub['revision']}`), {sha}, float32."]
        return base
    name = _folder_name(source.path, spec)
    base = Base(source, folder, name)
    base.facts = [f"Trained against the Hugging Face folder `{name}`, {sha}, float32."]
    return base
