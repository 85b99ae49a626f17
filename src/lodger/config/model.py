"""[model], [method] and [data]: what is trained, how, and on what."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from .base import Float, Int, Section

# What a preference objective's keys default to when left out (TRL's defaults, so runs compare).
PREFERENCE_DEFAULTS: dict[str, dict[str, float]] = {
    "dpo": {"beta": 0.1}, "orpo": {"beta": 0.1},
    "kto": {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0}}


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
    objective: Literal["sft", "dpo", "orpo", "kto", "grpo"] = "sft"
    """What the run learns from (docs/preference.md): `sft`, supervised fine-tuning on chats or text
    (loss on the assistant's tokens); `dpo`, Direct Preference Optimization on {"prompt", "chosen",
    "rejected"} pairs against the model as it is at step 0 (the reference); `orpo`, odds-ratio
    preference optimisation on the same pairs, without a reference (the chosen answer's loss plus
    beta x the odds-ratio term); `kto`, Kahneman-Tversky Optimization on {"prompt", "completion",
    "label"} lines labelled good (true) or bad (false)."""
    beta: Float | None = Field(None, gt=0)
    """Preference objectives only: DPO/KTO's beta (how far the model may move from the reference;
    smaller moves further), ORPO's weight of the odds-ratio term (its lambda). Default 0.1."""
    desirable_weight: Float | None = Field(None, gt=0)
    """KTO only: weight of the loss on lines labelled true (default 1.0). With unequal numbers of
    good and bad lines, weight the rarer kind up (the KTO paper's guidance: desirable x good lines
    about equal to undesirable x bad lines, within 1 to 1.33 times)."""
    undesirable_weight: Float | None = Field(None, gt=0)
    """KTO only: weight of the loss on lines labelled false (default 1.0)."""
    init_adapter: Path | None = None
    """Continue training this existing peft adapter folder (adapter_config.json +
    adapter_model.safetensors) instead of a fresh one; rank, alpha and target_modules are read from
    it (left out here, or equal)."""
    base_bits: Literal[4, 8] | None = None
    """LoRA only: hold the frozen base in 4 bits (NF4 with double quantisation, QLoRA) or 8 bits
    (LLM.int8), through bitsandbytes, on the CPU or a GPU; about a seventh (4) or a quarter (8) of its
    fp32 size. Left out: the base stays fp32. Its decoder layers' linear weights are quantised when
    loaded (the embeddings, norms and head stay fp32); the checkpoint names the quantised base by its
    sha256 instead of storing it (docs/qlora.md). Not on a GGUF source (the default SmolLM2 is one):
    it is quantised already; use the original model's folder or hub id."""
    use_dora: bool | None = None
    """LoRA only: DoRA (weight-decomposed LoRA): a trainable magnitude per output row of each adapted
    layer beside the low-rank direction; costs a norm of the (dequantised) weight per layer and step."""
    use_rslora: bool | None = None
    """LoRA only: rank-stabilised scaling, alpha / sqrt(rank) instead of alpha / rank."""
    init_lora: Literal["default", "gaussian"] | None = None
    """How a fresh adapter starts (peft's init_lora_weights): `default` (A Kaiming-uniform, B zero) or
    `gaussian` (A normal with standard deviation 1/rank, B zero). PiSSA and LoftQ are not offered:
    PiSSA rewrites the base (which a quantised base cannot take), and peft's LoftQ computes on a GPU only."""

    @model_validator(mode="before")
    @classmethod
    def _defaults_left_out(cls, raw: Any) -> Any:
        """`use_dora = false`, `use_rslora = false` and `init_lora = "default"` are the defaults: kept out
        of the resolved job, so a job that says them has the identity of one that does not."""
        if not isinstance(raw, dict):
            return raw
        defaults = {"use_dora": False, "use_rslora": False, "init_lora": "default"}
        said = {k for k, v in raw.items() if k in defaults and type(v) is type(defaults[k]) and v == defaults[k]}
        return {k: v for k, v in raw.items() if k not in said}

    @model_validator(mode="after")
    def _variants_fit(self) -> "MethodConfig":
        """Refuse a quantised base or a LoRA variant with what it cannot honour, naming the fix."""
        lora_only = [k for k in ("base_bits", "use_dora", "use_rslora", "init_lora") if getattr(self, k) is not None]
        if self.kind != "lora" and lora_only:
            key = lora_only[0]
            why = ("a quantised base is frozen and only a LoRA adapter trains on it" if key == "base_bits"
                   else "it is a variant of the LoRA adapter")
            raise ValueError(f"{key} = {getattr(self, key)!r} with kind = {self.kind!r}: {why}; set kind = \"lora\" "
                             f"or remove {key}")
        if self.use_dora and self.base_bits == 8:
            raise ValueError("use_dora = true with base_bits = 8: DoRA's weight norm reads the dequantised 8-bit "
                             "weight through peft, which loses its scales on bitsandbytes' CPU path (the first "
                             "step fails); use base_bits = 4 with DoRA, or plain LoRA on the 8-bit base")
        if self.use_dora and self.init_adapter is not None:
            raise ValueError("use_dora = true with init_adapter: the adapter being continued is plain LoRA and has "
                             "no magnitude vectors for DoRA to continue; remove use_dora, or init_adapter")
        return self

    @model_validator(mode="before")
    @classmethod
    def _objective_keys(cls, raw: Any) -> Any:
        """Fill a preference objective's defaults; refuse keys its objective does not use."""
        if not isinstance(raw, dict) or not isinstance(raw.get("objective", "sft"), str):
            return raw
        objective = raw.get("objective", "sft")
        defaults = PREFERENCE_DEFAULTS.get(objective, {})
        unused = [key for keys in PREFERENCE_DEFAULTS.values() for key in keys
                  if key in raw and raw[key] is not None and key not in defaults]
        if unused:
            users = sorted(o for o, keys in PREFERENCE_DEFAULTS.items() if unused[0] in keys)
            raise ValueError(f"{unused[0]} = {raw[unused[0]]!r} does nothing with objective = {objective!r} (it is "
                             f"a key of {' and '.join(users)}): remove it, or set objective to one of those")
        return {**defaults, **{k: v for k, v in raw.items() if v is not None or k not in defaults}}


class DataConfig(Section):
    train: Path
    """Training data: JSONL, one `{"messages": [...]}` chat or `{"text": ...}` per line (for
    [method] objective = "dpo"/"orpo": `{"prompt", "chosen", "rejected"}`; "kto": `{"prompt",
    "completion", "label"}`; strings, or message lists rendered with the chat template); a path
    (relative paths are taken from the job file's folder) or `dataset:NAME`, a dataset registered
    with `lodger data add`."""
    eval: Path | None = None
    """Held-out data in the same format (a path or `dataset:NAME`). When absent, `eval_fraction`
    of `train` is held out."""
    eval_fraction: Float = Field(0.1, ge=0.0, lt=1.0)
    """Share of the training lines held out for evaluation when `eval` is not given (0 disables eval)."""
    max_length: Int = Field(256, ge=8, le=131072)
    """Tokens per example; longer examples are truncated."""
