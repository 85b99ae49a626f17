"""The base model of a run as the world knows it: the hub id where known, the exact weights it was
trained against (for a GGUF base: the file, its quantisation, and that it was dequantised), whether
the export ships those weights or names where they are, and lines of Python that load them without
lodger."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ExportError, RunStateError
from ..model import ALIAS_HUB_IDS, ALIASES, HUB_ID, TOKENIZER_FILES, ModelSource, model_folder, resolve_source

BASE_MODES = ("auto", "ship", "name")
SHIPPED = "base"
"""The shipped base's folder inside the adapter folder; adapter_config names it `./base`."""
WEIGHT_FILES = ("config.json", "generation_config.json")


@dataclass
class Base:
    """What an export says about, and needs from, the run's base model."""

    source: ModelSource
    folder: Path                 # a Hugging Face folder with the weights trained against (cache for GGUF)
    name_or_path: str            # the base as the world names it (GGUF metadata, the card); never a cache path
    revision: str | None = None  # hub commit, where known
    gguf: dict | None = None     # {"file", "path", "quantisation"} when the base was a GGUF file
    facts: list[str] = field(default_factory=list)   # model card lines, exact and complete
    ship: bool = False           # the export carries the base's weights in <adapter>/base/
    quantisation: dict | None = None  # [method] base_bits: provenance's record of the quantised base

    @property
    def adapter_base(self) -> str:
        """adapter_config's base_model_name_or_path: the shipped folder, the GGUF file, or the name
        trained against (hub id or folder); never a hub id that was not itself trained against."""
        if self.ship:
            return f"./{SHIPPED}"
        return self.gguf["path"] if self.gguf else self.name_or_path

    @property
    def adapter_revision(self) -> str | None:
        return None if self.ship else self.revision

    def load_lines(self) -> list[str]:
        """Python that loads the base weights the adapter was trained against (no lodger); a snippet's
        ``folder`` is the adapter folder."""
        quantise = self.quantisation_lines()
        extra = ", quantization_config=quantised" if quantise else ""
        if self.ship:
            return [*quantise, f"base = AutoModelForCausalLM.from_pretrained(folder + '/{SHIPPED}'{extra})"
                    "  # shipped: the weights as trained"]
        if self.gguf:
            return [f"base = AutoModelForCausalLM.from_pretrained({str(Path(self.gguf['path']).parent)!r},",
                    f"                                            gguf_file={self.gguf['file']!r})"
                    "  # dequantised, as trained"]
        rev = f", revision={self.revision!r}" if self.revision else ""
        return [*quantise, f"base = AutoModelForCausalLM.from_pretrained({self.name_or_path!r}{rev}{extra})"]

    def quantisation_lines(self) -> list[str]:
        """A quantised base ([method] base_bits) as transformers rebuilds it: the same bitsandbytes
        configuration, which quantises these weights to the very tensors the adapter trained on."""
        q = self.quantisation
        if not q:
            return []
        if q["bits"] == 4:
            config = ("BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
                      "bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)")
        else:
            config = "BitsAndBytesConfig(load_in_8bit=True)"
        return ["import torch", "from transformers import BitsAndBytesConfig",
                f"quantised = {config}  # as trained: {q['library']} {q['version']}"]

    def where(self, adapter_folder: str) -> str:
        """One card line: does the export ship the base or name it, and where it is found offline."""
        inside = f"{adapter_folder}/{SHIPPED}".removeprefix("./")
        if self.ship:
            return (f"**Shipped**: `{inside}/` holds the base weights exactly as trained against (float32 "
                    "safetensors, config, tokenizer); `adapter_config.json` names it `./base`, relative to the "
                    "adapter folder, so nothing is looked up on the hub or in any cache.")
        if self.gguf:
            return (f"**Named, not shipped**: `adapter_config.json` names the GGUF file `{self.gguf['path']}`; "
                    "load it with `gguf_file=` as below (transformers dequantises it as lodger did).")
        if self.revision:
            return (f"**Named, not shipped**: `adapter_config.json` names `{self.name_or_path}` at revision "
                    f"`{self.revision}`; offline it is found in a Hugging Face cache that holds that snapshot.")
        return (f"**Named, not shipped**: `adapter_config.json` names the folder `{self.name_or_path}`, "
                "found offline where that folder exists.")

    def shipped_files(self) -> list[Path]:
        """The base folder's files an export ships: config, weights (safetensors), tokenizer."""
        names = [*WEIGHT_FILES, *TOKENIZER_FILES]
        files = [self.folder / n for n in names if (self.folder / n).is_file()]
        weights = sorted(p for p in self.folder.iterdir()
                         if p.is_file() and (p.name.endswith(".safetensors") or p.name.endswith(".safetensors.index.json")))
        if not weights:
            raise ExportError(f"--base ship: the base folder {self.folder} has no safetensors weights to ship; "
                              "use --base name")
        return files + weights


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


def describe_base(model_record: dict, mode: str = "auto") -> Base:
    """Resolve the run's base again (nothing is downloaded) and check it is the one trained against.

    ``mode``: "ship" puts the base's weights in the export, "name" names where they are, "auto"
    ships a GGUF base (its dequantised weights exist nowhere but lodger's cache) and names others."""
    if mode not in BASE_MODES:
        raise ExportError(f"--base {mode!r}: use one of {', '.join(BASE_MODES)}")
    spec = model_record["source"]
    source = resolve_source(spec)
    if source.sha256 != model_record.get("sha256"):
        raise RunStateError(f"the base model {spec!r} changed since the run (recorded sha256 "
                            f"{model_record.get('sha256')}, now {source.sha256}); restore it to export")
    folder = model_folder(source)
    base = _gguf_base(source, folder, spec) if source.kind == "gguf" else _hf_base(source, folder, spec)
    base.ship = mode == "ship" or (mode == "auto" and base.gguf is not None)
    quantisation = model_record.get("quantisation")
    if quantisation:
        from ..quant import describe

        base.quantisation = quantisation
        base.facts.append(f"**Trained on a quantised base**: while the adapter trained, the base's decoder-layer "
                          f"linear weights were held in {describe(quantisation['bits'])} {quantisation['version']} "
                          f"(sha256 of the quantised tensors `{quantisation['sha256']}`), quantised from the weights "
                          "above as they loaded. The adapter belongs with that quantised base: load the base with "
                          "the BitsAndBytesConfig shown below. The merged folder and the GGUF file hold the "
                          "quantised base dequantised to float32 with the adapter merged in. lodger computed "
                          "every 4-bit layer on bitsandbytes' float32 path, in training and evaluation alike; "
                          "without gradients on a CPU with AVX512-BF16 bitsandbytes computes in bfloat16 instead, "
                          "so there the adapter's outputs are close to, not exactly, lodger's.")
    return base


def _gguf_base(source: ModelSource, folder: Path, spec: str) -> Base:
    sha = f"sha256 `{source.sha256}`"
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


def _hf_base(source: ModelSource, folder: Path, spec: str) -> Base:
    sha = f"sha256 `{source.sha256}`"
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
