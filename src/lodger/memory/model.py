"""The model side of the estimator: a decoder's shape from config.json, and what its pieces cost
per token (parameters, saved activations, logits, floating-point operations).

Pure arithmetic, no torch: ``memory.estimate`` adds these up with the measured and calibrated
items (runtime, allocator, buffers). Precision facts (bytes of a value, whether autocast casts)
come from ``train/precision.py``'s table. The op-by-op counts are explained in docs/memory.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ModelSourceError
from ..train.throughput import token_flops as flops_formula

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..train.precision import Mode

# Linear layers of a Llama-style decoder layer: name -> (in, out) as functions of the shape.
_LAYER_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Shape:
    """The architecture numbers the estimate needs, from config.json."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def module_dims(self, name: str) -> tuple[int, int]:
        """(in, out) features of a linear layer by its name; unknown names count as hidden x hidden."""
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
                "lm_head": (h, self.vocab), "embed_tokens": (self.vocab, h)}.get(name, (h, h))

    @property
    def layer_linear_params(self) -> int:
        return sum(a * b for a, b in map(self.module_dims, _LAYER_MODULES))

    @property
    def total_params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * (self.layer_linear_params + 2 * self.hidden) + self.hidden


def model_shape(config: dict[str, Any]) -> Shape:
    """Read the architecture from a config.json dict (multimodal configs: their text_config)."""
    if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
        config = {**config["text_config"], "tie_word_embeddings": config.get("tie_word_embeddings", False)}
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in needed if not isinstance(config.get(k), int)]
    if missing:
        raise ModelSourceError(f"config.json lacks {', '.join(missing)}: the memory estimate needs a "
                               "decoder-only transformer config (Llama, Qwen, Mistral, SmolLM ...)")
    h, heads = config["hidden_size"], config["num_attention_heads"]
    return Shape(hidden=h, layers=config["num_hidden_layers"], heads=heads,
                 kv_heads=config.get("num_key_value_heads") or heads,
                 head_dim=config.get("head_dim") or h // heads,
                 intermediate=config.get("intermediate_size") or 4 * h,
                 vocab=config["vocab_size"], tied=bool(config.get("tie_word_embeddings", False)))


def trainable_params(shape: Shape, method) -> int:
    """Parameters the optimizer updates: all for `full`; r*(in+out) per adapted layer for LoRA, and
    with DoRA a magnitude per output row."""
    if method.kind == "full":
        return shape.total_params
    total = 0
    dora = bool(getattr(method, "use_dora", None))
    for name in method.target_modules:
        n_in, n_out = shape.module_dims(name)
        per_layer = method.rank * (n_in + n_out) + (n_out if dora else 0)
        total += per_layer * (1 if name in ("lm_head", "embed_tokens") else shape.layers)
    return total


# -- a quantised base ([method] base_bits; quant.py) ---------------------------------------------
# Bytes per quantised weight: NF4 packs two to a byte, with a uint8 scale per 64 and an fp32 scale
# per 256 of those (double quantisation); LLM.int8 is a byte each and an fp32 scale per output row.
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


def quantised_params(shape: Shape) -> int:
    """Weights a quantised base holds in 4 or 8 bits: every linear layer of every decoder layer
    (transformers keeps the embeddings, the norms and the head in fp32)."""
    return shape.layers * shape.layer_linear_params


def base_bytes(shape: Shape, bits: int | None) -> float:
    """The frozen base's resident bytes: fp32, or its decoder layers' linears quantised."""
    if bits is None:
        return 4.0 * shape.total_params
    quantised = quantised_params(shape)
    rest = 4.0 * (shape.total_params - quantised)
    if bits == 4:
        return rest + NF4_BYTES * quantised
    rows = shape.layers * sum(shape.module_dims(name)[1] for name in _LAYER_MODULES)
    return rest + quantised + 4.0 * rows


def largest_linear(shape: Shape) -> int:
    """Weights of the largest linear layer of a decoder layer (its dequantised fp32 copy is the
    biggest scratch a quantised base needs at once)."""
    return max(a * b for a, b in map(shape.module_dims, _LAYER_MODULES))


def adapter_extras(shape: Shape, method, tokens: int, precision: "Mode") -> float:
    """Bytes autograd saves per micro-batch of ``tokens`` beyond plain LoRA on an fp32 base, in all
    layers: DoRA keeps the base's and the adapter's outputs of each adapted layer (for the gradient
    of its magnitude), and with dropout the dequantised weight its second matmul reads; an 8-bit
    base's matmul keeps every quantised layer's input (bitsandbytes' CPU training path), where
    plain LoRA kept only the adapted layers' inputs."""
    e = precision.value_bytes
    targets = [t for t in method.target_modules if t not in ("lm_head", "embed_tokens")]
    per_layer = 0.0
    if getattr(method, "use_dora", None):
        for name in targets:
            n_in, n_out = shape.module_dims(name)
            per_layer += 2 * n_out * e * tokens + (4 * n_in * n_out if method.dropout > 0 else 0)
    if getattr(method, "base_bits", None) == 8:
        groups = {"attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj"), "down": ("down_proj",)}
        kept = set() if method.dropout > 0 else {g for g, names in groups.items() if set(names) & set(targets)}
        widths = {"attn": shape.hidden, "mlp": shape.hidden, "down": shape.intermediate}
        per_layer += sum(width * e * tokens for group, width in widths.items() if group not in kept)
    return shape.layers * per_layer


# -- activations ------------------------------------------------------------------------------
def _layer_bytes(shape: Shape, seq: int, method, precision: "Mode") -> float:
    """Bytes autograd saves per token in one decoder layer (no checkpointing).

    Counted from the saved tensors of each op (fp32 / bf16 autocast, SDPA on CPU):
    RMSNorm keeps its input (and x*rsqrt when its weight trains) in fp32; each linear keeps its
    input when its weight trains (under autocast, one bf16 cast per linear); SDPA keeps q, k, v
    (k and v repeated to every head), the output, the log-sum-exp and a float copy of the mask
    (seq values per token); the MLP keeps gate, silu(gate), up and their product.
    """
    h, q, i, e = shape.hidden, shape.q_dim, shape.intermediate, precision.value_bytes
    half = precision.autocast  # autocast casts each linear's input (and weight) to the half dtype
    attention = 4 * q * e + seq * e + 4 * shape.heads
    if method.kind == "full":
        norms = 4 * h * 4
        linear_inputs = (5 * h if half else 2 * h) * e   # bf16: q,k,v,gate,up each cast normed input
        return norms + linear_inputs + attention + 4 * i * e
    targets = [t for t in method.target_modules if t not in ("lm_head", "embed_tokens")]
    dropout = getattr(method, "dropout", 0.0) > 0
    inputs = 0.0
    shared: set[str] = set()
    for name in targets:
        n_in = shape.module_dims(name)[0]
        if name == "o_proj":
            continue                                  # its input is SDPA's output, kept anyway
        if dropout:
            inputs += n_in * (e + 1)                  # dropout output + its bool mask, per adapter
            continue
        group = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp",
                 "up_proj": "mlp"}.get(name, name)
        if half and name != "down_proj":
            inputs += n_in * e                        # autocast casts the input once per linear
        elif group not in shared:
            shared.add(group)
            inputs += n_in * e
    lora_mid = method.rank * len(targets) * e
    return 2 * h * 4 + inputs + lora_mid + attention + 3 * i * e


def layer_bytes(shape: Shape, tokens: int, seq: int, method, *, precision: "Mode") -> float:
    """Bytes autograd saves in one decoder layer for a micro-batch of ``tokens``."""
    return _layer_bytes(shape, seq, method, precision) * tokens


def activation_parts(shape: Shape, tokens: int, seq: int, method, *, precision: "Mode",
                     checkpointing: bool) -> tuple[float, float]:
    """(saved activations, one recomputed layer) in bytes for a micro-batch of ``tokens``."""
    layer = _layer_bytes(shape, seq, method, precision) * tokens
    if method.kind == "full":
        final = (8 * shape.hidden + 2 * shape.hidden if precision.autocast else 12 * shape.hidden) * tokens
    else:
        final = 4 * shape.hidden * tokens
    if checkpointing:
        # Non-reentrant checkpointing keeps each layer's input (the fp32 residual stream); the
        # backward pass recomputes one layer at a time.
        return shape.layers * 4 * shape.hidden * tokens + final, layer
    return shape.layers * layer + final, 0.0


def logits_bytes(shape: Shape, batch: int, seq: int, *, head_only: bool = False,
                 head_trains: bool = False) -> float:
    """Peak of ``token_loss_sum`` and its backward pass. Whole logits: the logits, their
    log-softmax and the logits' gradient (fp32), 12 bytes per token and vocabulary entry
    (measured). ``head_only`` (train/loss.py): two chunks of logits, the hidden states' gradient
    and, when the head trains, its fp32 gradient."""
    if not head_only:
        return 12 * batch * seq * shape.vocab
    from ..train.loss import CHUNK_BYTES

    chunk = min(CHUNK_BYTES + 4 * shape.vocab, 4 * batch * seq * shape.vocab)
    return 2 * chunk + 4 * batch * seq * shape.hidden + (4 * shape.vocab * shape.hidden if head_trains else 0)


def head_only_loss(model_config: dict, autocast: bool) -> bool:
    """Whether a run's loss takes the head on labelled positions only (train/loss.head_parts),
    from config.json: a model type whose logits are the head's output, no autocast."""
    from ..train.loss import HEAD_ONLY

    return not autocast and model_config.get("model_type") in HEAD_ONLY


def token_flops(shape: Shape, method, context: float) -> tuple[float, float]:
    """(model FLOPs, recomputation FLOPs) per computed position of a micro-batch whose rows are
    ``context`` positions wide, by train/throughput.token_flops (the formula the step line's MFU
    uses): 6N per token for full fine-tuning, 4N + 2R for LoRA, plus the attention. Gradient
    checkpointing recomputes the forward but lm_head: time, not model FLOPs."""
    lm_head = shape.vocab * shape.hidden
    matmul = shape.layers * shape.layer_linear_params + lm_head
    lora = 0 if method.kind == "full" else trainable_params(shape, method)
    model = flops_formula(matmul + lora, matmul if method.kind == "full" else lora,
                          shape.q_dim * shape.layers, context)
    recompute = 2 * (matmul + lora - lm_head) + 4 * context * shape.q_dim * shape.layers
    return float(model), float(recompute)


def step_flops(job: "JobConfig", model_config: dict, *, seq_len: float | None = None) -> float:
    """Floating-point operations of one optimizer step (every micro-batch, forward and backward,
    recomputation included) when each micro-batch is ``batch_size`` rows of ``seq_len`` positions
    (the padded width, or a packed row's length)."""
    shape = model_shape(model_config)
    cfg, method = job.training, job.method
    seq = float(seq_len or job.data.max_length)
    model, recompute = token_flops(shape, method, seq)
    per_token = model + (recompute if cfg.gradient_checkpointing else 0.0)
    objective = getattr(method, "objective", "sft")
    rows = cfg.batch_size * (2 if objective in ("dpo", "orpo") else 1)  # a pair is two sequences
    if objective == "kto":  # the KL sequences' forward pass, without gradients: a third (full) or half (LoRA)
        per_token += model / (3 if method.kind == "full" else 2)
    if objective == "grpo":
        # G completions per prompt, each position sampled with one forward pass (the KV cache keeps the
        # rest), then the loss's forward and backward over prompt and completion, and a forward pass
        # more for the log-probabilities at sampling time (mu > 1) and under the reference (beta > 0):
        # a forward pass is a third (full) or half (LoRA) of the step's model FLOPs.
        grpo = job.grpo
        rows, seq = cfg.batch_size * grpo.num_generations, seq + grpo.max_completion_length
        forward = model / (3 if method.kind == "full" else 2)
        passes = 1 + (grpo.num_iterations > 1) + (grpo.beta > 0)
        per_token += forward * passes / grpo.num_iterations  # sampled once every num_iterations steps
    return cfg.grad_accum * rows * seq * per_token
