"""[model], [method] and [data]: what is trained, how, and on what."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from .base import Float, Int, Section

class ModelConfig(Section):
    source: str = Field("smollm2-135m-instruct", min_length=1)
    """The base model: the alias `smollm2-135m-instruct`, a local Hugging Face folder (config.json +
    safetensors), a .gguf file, or a hub id (`org/name`, `org/name@revision`) already in the local
    Hugging Face cache (HF_HUB_CACHE / HF_HOME). Nothing is ever downloaded."""
    revision: str | None = None
    """For a hub id: the branch, tag or commit of the cached snapshot to use (default `main`)."""


class MethodConfig(Section):
    kind: Literal["lora", "full"] = "lora"
    """`lora` trains a small adapter (peft); `full` trains every weight of the model."""
    rank: Int = Field(8, ge=1, le=1024)
    """LoRA rank r: the width of the low-rank update."""
    alpha: Float = Field(16.0, gt=0)
    """LoRA alpha: the update is scaled by alpha / rank."""
    dropout: Float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA input during training (0 disables it)."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], min_length=1)
    """Names of the linear layers that get an adapter, e.g. ["q_proj", "k_proj", "v_proj", "o_proj"]."""
    init_adapter: Path | None = None
    """Continue training this existing peft adapter folder (adapter_config.json +
    adapter_model.safetensors) instead of a fresh one; rank, alpha and target_modules are read from
    it (left out here, or equal)."""


class DataConfig(Section):
    train: Path
    """Training data: JSONL, one `{"messages": [...]}` chat or `{"text": ...}` per line; a path
    (relative paths are taken from the job file's folder) or `dataset:NAME`, a dataset registered
    with `lodger data add`."""
    eval: Path | None = None
    """Held-out data in the same format (a path or `dataset:NAME`). When absent, `eval_fraction`
    of `train` is held out."""
    eval_fraction: Float = Field(0.1, ge=0.0, lt=1.0)
    """Share of the training lines held out for evaluation when `eval` is not given (0 disables eval)."""
    max_length: Int = Field(256, ge=8, le=131072)
    """Tokens per example; longer examples are truncated."""
