"""The estimator: peak memory and time of a training job, from the model's config.json.

Peak resident memory (CPU) is the sum of these items (``Estimate.items``, bytes):

* runtime: the process after importing torch, transformers and peft (measured once, cached).
* weights: every parameter in fp32 (lodger loads fp32), plus the LoRA matrices.
* gradients, optimizer: an fp32 gradient and two fp32 AdamW moments per trainable parameter.
* activations: the tensors autograd saves for the backward pass, counted op by op on Llama-style
  models (transformers 5, torch 2.13, SDPA on CPU, which keeps q, k and v repeated to every
  head, the output and a float copy of the padding mask); see ``_layer_bytes``. With gradient
  checkpointing: each layer's input plus one recomputed layer.
* logits_and_loss: ``token_loss_sum`` and its backward pass hold the logits, their log-softmax and
  the logits' gradient at once: 12 bytes per token and vocabulary entry (SmolLM2: 49,152 entries).
* autocast_copies (bf16/fp16): autocast casts every linear weight once per step and keeps the
  copy until the backward pass, half the fp32 weights; on CPU this can outweigh what
  half-precision activations save (SmolLM2 LoRA, seq 128, measured: bf16 1.70 GiB, fp32 1.50).
* checkpoint: what writing a checkpoint adds (CHECKPOINT_COPIES x the trainable weights). Files
  are streamed from the tensors' own memory (``tensorfile.py``), so this is next to nothing; it
  was 5 x, and the peak of full fine-tuning, while checkpoints were serialised to bytes first.
* buffers: tokenizer, attention mask, kernels' scratch.
* allocator: what glibc keeps resident after freeing it (see ALLOCATOR_RETAINED).

``total_bytes`` is the sum less ``overlap_bytes``, the items never resident at the same moment.
With glibc's default allocator that is only the logits, freed before a checkpoint is built: the
heap keeps what activations free during the backward pass instead of handing it to the
gradients (measured). With the mmap threshold pinned (``pin_allocator``), or on a GPU, the
resident set is the live set: activations and gradients of full fine-tuning, and the step's
memory and the checkpoint, are not resident together.

The constants were fitted to the peak RSS (VmHWM) of real steps of lodger's own training pieces,
each in a fresh process (``measure``); ``bench/memory.py`` prints the comparison for SmolLM2.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import LodgerError, ModelSourceError

if TYPE_CHECKING:
    from .config import JobConfig

GiB = 2**30

# -- calibrated constants ---------------------------------------------------------------------
TOKENIZER_FIXED = int(2.5 * 2**20)   # a loaded fast tokenizer: its first template and tables
TOKENIZER_BYTES_PER_VOCAB = 940     # ... and per vocabulary entry (SmolLM2, 49,152 entries: 46 MB)
BUFFERS_FIXED = 8 * 2**20           # model-independent scratch: autograd engine, kernels' workspaces
# With glibc's default (dynamic) mmap threshold, the first tensors freed raise the threshold to
# their size, so from then on activation-sized tensors come from the heap, and what a step frees
# stays resident, only partly reusable by the next step's differently sized tensors. Measured on
# SmolLM2 (LoRA and full, seq 128/256, with and without checkpointing): gradients never reuse
# what the activations free (so both count in full), and about half of the step's transient bytes
# (activations, logits, autocast copies) stay resident on top, except that the gradients' own
# memory, freed at every zero_grad, absorbs it. With the threshold pinned (pin_allocator) the
# measured peak is the live set.
ALLOCATOR_RETAINED = 0.5
# Whether `lodger run` pins the threshold (pin_allocator) at start-up. It does not: pinned, SmolLM2
# LoRA seq 128 peaked at 1.30 GiB instead of 1.49 but its steps took 1.53 s instead of 1.0 (idle
# machine), every large tensor becoming a fresh mapping whose pages are faulted in again.
RUNS_PIN_ALLOCATOR = False
GPU_CONTEXT_BYTES = 600 * 2**20     # CUDA context + cuBLAS workspace (uncalibrated: no GPU here)
GPU_ALLOCATOR_FRACTION = 0.10       # caching-allocator fragmentation on GPU (uncalibrated)
# Share of the matmul benchmark's rate a training step reaches: 0.65-0.7 on SmolLM2 (fp32, LoRA
# and full, seq 128, 2 threads) on an idle machine, where a step took 1.0-1.6 s. Under other load
# the 0.2 s benchmark and a sustained step get different shares of the cores (0.1-0.8 measured),
# so a time estimate is only as steady as the machine's load.
MATMUL_EFFICIENCY = 0.6
CHECKPOINT_COPIES = 0               # extra memory of writing a checkpoint, x the trainable weights (streamed)

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
    """Parameters the optimizer updates: all for `full`; r*(in+out) per adapted layer for LoRA."""
    if method.kind == "full":
        return shape.total_params
    total = 0
    for name in method.target_modules:
        n_in, n_out = shape.module_dims(name)
        total += method.rank * (n_in + n_out) * (1 if name in ("lm_head", "embed_tokens") else shape.layers)
    return total


# -- activations ------------------------------------------------------------------------------
def _layer_bytes(shape: Shape, seq: int, method, half: bool) -> float:
    """Bytes autograd saves per token in one decoder layer (no checkpointing).

    Counted from the saved tensors of each op (fp32 / bf16 autocast, SDPA on CPU):
    RMSNorm keeps its input (and x*rsqrt when its weight trains) in fp32; each linear keeps its
    input when its weight trains (under autocast, one bf16 cast per linear); SDPA keeps q, k, v
    (k and v repeated to every head), the output, the log-sum-exp and a float copy of the mask
    (seq values per token); the MLP keeps gate, silu(gate), up and their product.
    """
    h, q, i, e = shape.hidden, shape.q_dim, shape.intermediate, (2 if half else 4)
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


def activation_parts(shape: Shape, tokens: int, seq: int, method, *, half: bool,
                     checkpointing: bool) -> tuple[float, float]:
    """(saved activations, one recomputed layer) in bytes for a micro-batch of ``tokens``."""
    layer = _layer_bytes(shape, seq, method, half) * tokens
    if method.kind == "full":
        final = (8 * shape.hidden + 2 * shape.hidden if half else 12 * shape.hidden) * tokens
    else:
        final = 4 * shape.hidden * tokens
    if checkpointing:
        # Non-reentrant checkpointing keeps each layer's input (the fp32 residual stream); the
        # backward pass recomputes one layer at a time.
        return shape.layers * 4 * shape.hidden * tokens + final, layer
    return shape.layers * layer + final, 0.0


def logits_bytes(shape: Shape, batch: int, seq: int) -> float:
    """Peak of ``token_loss_sum`` and its backward pass: the logits, their log-softmax and the
    logits' gradient (fp32), 12 bytes per token and vocabulary entry (measured)."""
    return 12 * batch * seq * shape.vocab


# -- the estimate -----------------------------------------------------------------------------
@dataclass
class Estimate:
    """Peak memory of one training job, item by item, in bytes."""

    items: dict[str, int]
    trainable_params: int
    total_params: int
    total_bytes: int
    largest: str
    device: str
    batch_size: int
    seq_len: int
    overlap_bytes: int = 0              # bytes of items never resident at the same moment
    step_seconds: float | None = None
    job_seconds: float | None = None
    flops_per_step: float | None = None
    _inputs: dict = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("_inputs")
        return data


def estimate(job: "JobConfig", model_config: dict, *, seq_len: int | None = None,
             runtime_bytes: int | None = None, device: str = "cpu",
             flops_per_second: float | None = None, total_steps: int | None = None,
             pinned_allocator: bool | None = None) -> Estimate:
    """Peak memory of ``job`` on ``device`` ("cpu": resident set; "cuda": GPU memory).

    ``seq_len`` defaults to [data] max_length (the widest batch); ``runtime_bytes`` to
    ``runtime_bytes()`` on CPU; ``pinned_allocator`` to RUNS_PIN_ALLOCATOR (whether the training
    process pins glibc's mmap threshold). With ``flops_per_second`` (see ``flops_per_second()``) the
    estimate also carries seconds per optimizer step and, when the step count is known, per job.
    """
    shape = model_shape(model_config)
    cfg, method = job.training, job.method
    seq = int(seq_len or job.data.max_length)
    batch = cfg.batch_size
    tokens = batch * seq
    half = cfg.precision in ("bf16", "fp16")
    gpu = device.startswith("cuda")
    total = shape.total_params
    trainable = trainable_params(shape, method)

    weights = 4 * total + (4 * trainable if method.kind == "lora" else 0)
    gradients = 4 * trainable
    optimizer = 8 * trainable
    saved, recomputed = activation_parts(shape, tokens, seq, method, half=half,
                                         checkpointing=cfg.gradient_checkpointing)
    activations = saved + recomputed
    loss = logits_bytes(shape, batch, seq)
    copies = 0.0
    if half:  # one half-precision copy of every linear weight (lm_head too, even when tied)
        copies = 2 * (shape.layers * shape.layer_linear_params + shape.vocab * shape.hidden)
        copies += 2 * trainable if method.kind == "lora" else 0
    mask = batch * seq * seq  # the boolean causal/padding mask, built once per forward
    buffers = BUFFERS_FIXED + mask + (0 if gpu else TOKENIZER_FIXED + TOKENIZER_BYTES_PER_VOCAB * shape.vocab)
    transient = activations + loss + copies       # freed again by the end of each step
    # Writing a checkpoint between steps (Session.save_checkpoint): see CHECKPOINT_COPIES.
    checkpoint = 0.0 if gpu else CHECKPOINT_COPIES * 4 * trainable
    if gpu:
        runtime = GPU_CONTEXT_BYTES if runtime_bytes is None else runtime_bytes
        allocator = GPU_ALLOCATOR_FRACTION * transient
        overlap = _not_alive_together(transient, gradients, checkpoint, method.kind)
    else:
        runtime = _measured_runtime(threads=cfg.threads) if runtime_bytes is None else runtime_bytes
        pinned = RUNS_PIN_ALLOCATOR if pinned_allocator is None else pinned_allocator
        if pinned:   # freed memory goes straight back to the system: resident = alive
            allocator = 0.0
            overlap = _not_alive_together(transient, gradients, checkpoint, method.kind)
        else:        # glibc's dynamic mmap threshold (see ALLOCATOR_RETAINED): the heap keeps what a
            # step freed, except the logits, whose blocks are too big for it; the checkpoint's
            # bytes come on top of the rest
            allocator = max(0.0, ALLOCATOR_RETAINED * transient - gradients)
            overlap = min(checkpoint, loss)
    items = {"runtime": runtime, "weights": weights, "gradients": gradients, "optimizer": optimizer,
             "activations": activations, "logits_and_loss": loss, "checkpoint": checkpoint,
             "buffers": buffers, "allocator": allocator}
    if half:
        items["autocast_copies"] = copies
    items = {k: int(round(v)) for k, v in items.items()}
    overlap = int(round(overlap))
    total_bytes = sum(items.values()) - overlap
    largest = max((k for k in items if k != "runtime"), key=lambda k: items[k])
    est = Estimate(items=items, trainable_params=trainable, total_params=total, total_bytes=total_bytes,
                   largest=largest, device=device, batch_size=batch, seq_len=seq, overlap_bytes=overlap,
                   _inputs={"model_config": model_config, "runtime_bytes": runtime, "device": device,
                            "pinned_allocator": pinned_allocator})
    if flops_per_second:
        est.flops_per_step, est.step_seconds, est.job_seconds = estimate_time(
            job, model_config, flops_per_second, seq_len=seq, total_steps=total_steps)
    return est


def _not_alive_together(transient: float, gradients: float, checkpoint: float, kind: str) -> float:
    """Bytes of items never alive at the same moment when freed memory is reused at once: the
    backward pass frees activations as it fills the gradients (full fine-tuning), and a checkpoint
    is built between steps, when both are free again."""
    step = max(transient + (gradients if kind == "lora" else 0), gradients)
    return transient + gradients + checkpoint - max(step, checkpoint)


def step_flops(job: "JobConfig", model_config: dict, *, seq_len: int | None = None) -> float:
    """Floating-point operations of one optimizer step (every micro-batch, forward and backward)."""
    shape = model_shape(model_config)
    cfg = job.training
    seq = int(seq_len or job.data.max_length)
    tokens = cfg.batch_size * seq
    matmul = 2 * (shape.layers * shape.layer_linear_params + shape.vocab * shape.hidden) * tokens
    attention = 4 * cfg.batch_size * seq * seq * shape.q_dim * shape.layers
    forward = matmul + attention
    # Backward: gradients of the inputs always; of the weights only for full fine-tuning.
    backward = 2 * matmul + 2 * attention if job.method.kind == "full" else matmul + 2 * attention
    recompute = (forward - 2 * shape.vocab * shape.hidden * tokens) if cfg.gradient_checkpointing else 0
    return cfg.grad_accum * (forward + backward + recompute)


def estimate_time(job: "JobConfig", model_config: dict, flops_per_second: float, *,
                  seq_len: int | None = None, total_steps: int | None = None) -> tuple[float, float, float | None]:
    """(flops per step, seconds per optimizer step, seconds for the whole job or None).

    The step count comes from [training] steps, or from ``total_steps`` for epoch-based jobs."""
    flops = step_flops(job, model_config, seq_len=seq_len)
    step = flops / (flops_per_second * MATMUL_EFFICIENCY)
    steps = job.training.steps if job.training.steps is not None else total_steps
    return flops, step, (step * steps if steps else None)


# -- suggestions ------------------------------------------------------------------------------
def _fmt(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _apply(job: "JobConfig", changes: dict[str, dict]) -> "JobConfig":
    """A copy of ``job`` with some [section] keys changed."""
    for section, values in changes.items():
        job = job.model_copy(update={section: getattr(job, section).model_copy(update=values)})
    return job


def _again(est: Estimate, job: "JobConfig", seq_len: int | None = None) -> Estimate:
    i = est._inputs
    return estimate(job, i["model_config"], seq_len=seq_len or est.seq_len, runtime_bytes=i["runtime_bytes"],
                    device=i["device"], pinned_allocator=i["pinned_allocator"])


def suggestions(est: Estimate, job: "JobConfig", available_bytes: int) -> list[str]:
    """What would make the job fit in ``available_bytes``, each with the total it would need.

    The first line names the largest item; then every single change that lowers the total
    (marked when it alone fits); then the best combination when none is enough alone."""
    cfg = job.training
    lines = [f"the largest item is {est.largest}: {_fmt(est.items[est.largest])} of {_fmt(est.total_bytes)} "
             f"in all, with {_fmt(available_bytes)} available"]
    options: list[tuple[str, dict, int | None]] = []   # (advice, changes, sequence length if changed)
    if job.method.kind == "full":
        options.append(('train a LoRA adapter instead of every weight ([method] kind = "lora")',
                        {"method": {"kind": "lora"}}, None))
    if cfg.batch_size > 1:
        effective = cfg.batch_size * cfg.grad_accum
        divisors = [d for d in range(cfg.batch_size - 1, 0, -1) if cfg.batch_size % d == 0]
        chosen = next((d for d in divisors if _again(est, _apply(job, {"training": {
            "batch_size": d, "grad_accum": effective // d}})).total_bytes <= available_bytes), 1)
        options.append((f"[training] batch_size = {chosen} with grad_accum = {effective // chosen} "
                        f"(the same {effective} examples per step)",
                        {"training": {"batch_size": chosen, "grad_accum": effective // chosen}}, None))
    if not cfg.gradient_checkpointing:
        options.append(("[training] gradient_checkpointing = true (recomputes activations: about a third more "
                        "time)", {"training": {"gradient_checkpointing": True}}, None))
    if cfg.precision == "fp32":
        options.append(('[training] precision = "bf16"', {"training": {"precision": "bf16"}}, None))
    if est.seq_len > 64:
        shorter = max(64, est.seq_len // 2)
        options.append((f"[data] max_length = {shorter} (longer examples are cut)",
                        {"data": {"max_length": shorter}}, shorter))
    helpful: list[tuple[int, str, dict]] = []
    any_fits = False
    for text, changes, seq in options:
        after = _again(est, _apply(job, changes), seq)
        if after.total_bytes >= est.total_bytes:
            continue
        fits = after.total_bytes <= available_bytes
        any_fits |= fits
        lines.append(f"{text}: {est.largest} {_fmt(est.items[est.largest])} -> "
                     f"{_fmt(after.items.get(est.largest, 0))}, total {_fmt(after.total_bytes)} "
                     f"({'fits' if fits else 'still too big'})")
        if seq is None:  # a shorter max_length changes what is learnt: never combined silently
            helpful.append((after.total_bytes, text.split(" (")[0], changes))
    if not any_fits and len(helpful) > 1:
        # Greedily combine the changes, best first, keeping each only if it still lowers the total.
        combined, total, used = job, est.total_bytes, []
        for _, text, changes in sorted(helpful, key=lambda h: h[0]):
            candidate = _again(est, _apply(combined, changes)).total_bytes
            if candidate < total:
                combined, total = _apply(combined, changes), candidate
                used.append(text)
        if len(used) > 1:
            fits = total <= available_bytes
            any_fits |= fits
            lines.append(f"together, {' and '.join(used)}: total {_fmt(total)} "
                         f"({'fits' if fits else 'still too big'})")
    if not any_fits:
        lines.append("or free memory (close other programs), or raise [limits] memory_gb if it is below "
                     "what the machine has")
    return lines


# -- measurements of this machine -------------------------------------------------------------
def _proc_status(key: str) -> int:
    """A /proc/self/status value (VmRSS, VmHWM, ...) in bytes; 0 where there is no /proc."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def pin_allocator(threshold: int = 64 * 1024) -> bool:
    """Fix glibc's mmap threshold, so every block of ``threshold`` bytes or more is its own mapping,
    returned to the system the moment it is freed: the resident set then follows the live tensors
    instead of keeping what earlier steps freed (SmolLM2: 10-18 % less peak), at the price of
    page faults on every new tensor (steps up to 50 % slower when they take about a second).
    Call it once, as early as possible. Returns False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False


def memory_available() -> int:
    """MemAvailable from /proc/meminfo (bytes), or psutil's figure elsewhere."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(psutil.virtual_memory().available)


_RUNTIME_PROBE = r"""
import sys, torch, transformers, peft
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from peft import LoraConfig, get_peft_model
torch.set_num_threads(int(sys.argv[1]))
# One small training step loads the kernels' code and starts the thread pool, as a real run does.
layer = torch.nn.Linear(64, 64)
opt = torch.optim.AdamW(layer.parameters(), fused=True)
x = torch.randn(2, 4, 16, 64)
y = torch.nn.functional.scaled_dot_product_attention(x, x, layer(x), attn_mask=torch.ones(16, 16, dtype=torch.bool))
torch.nn.functional.cross_entropy(y.reshape(-1, 64), torch.zeros(128, dtype=torch.long)).backward()
opt.step()
with open("/proc/self/status") as fh:
    print([int(l.split()[1]) * 1024 for l in fh if l.startswith("VmRSS:")][0])
"""


def _runtime_key(threads: int) -> str:
    from importlib.metadata import version

    from . import __version__

    parts = [sys.version, str(threads)] + [version(p) for p in ("torch", "transformers", "peft")] + [__version__]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def runtime_bytes(*, threads: int | None = None, use_current: bool = True) -> int:
    """Resident size of a process that has imported torch, transformers and peft.

    Measured in this process when it has imported all three (``use_current``), else once in a
    fresh subprocess and cached under $LODGER_HOME/cache/runtime/ by library versions."""
    if use_current and all(m in sys.modules for m in ("torch", "transformers", "peft")):
        rss = _proc_status("VmRSS")
        if rss:
            return rss
    from . import durable
    from .home import cache_dir

    threads = threads or len(os.sched_getaffinity(0))
    memo = cache_dir("runtime") / f"{_runtime_key(threads)}.json"
    if memo.is_file():
        try:
            return int(json.loads(memo.read_text())["rss_bytes"])
        except (ValueError, KeyError):
            memo.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _RUNTIME_PROBE, str(threads)], capture_output=True,
                          text=True, env=env, timeout=300)
    if done.returncode != 0:
        raise LodgerError(f"could not measure the size of the training runtime: "
                          f"{done.stderr.strip().splitlines()[-1:] or done.returncode}")
    rss = int(done.stdout.split()[-1])
    durable.atomic_write(memo, json.dumps({"rss_bytes": rss, "threads": threads}).encode())
    return rss


_measured_runtime = runtime_bytes  # estimate() has a keyword argument of the same name


def flops_per_second(threads: int | None = None, precision: str = "fp32", seconds: float = 0.2) -> float:
    """Matmul rate of this machine at ``threads`` threads (a ~0.2 s benchmark)."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    before = torch.get_num_threads()
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    try:
        a = torch.randn(512, 1024, dtype=dtype)
        b = torch.randn(1024, 1024, dtype=dtype)
        torch.mm(a, b)  # warm-up: first call picks kernels
        flops, started = 0.0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            torch.mm(a, b)
            flops += 2 * 512 * 1024 * 1024
        return flops / (time.perf_counter() - started)
    finally:
        torch.set_num_threads(before)


# -- measuring real steps -----------------------------------------------------------------------
@dataclass
class Measurement:
    """Peak resident memory of a few real training steps, measured in a fresh process."""

    peak_bytes: int                 # VmHWM at the end (the steps, then a checkpoint's bytes)
    import_bytes: int               # VmRSS after the imports
    step_peaks: list[int]           # VmHWM after each step
    step_seconds: list[float]
    phases: dict[str, int]          # VmRSS after each phase


def measure(job: "JobConfig", folder: Path, *, seq_len: int | None = None, steps: int = 2,
            timeout: float | None = None, pinned_allocator: bool | None = None) -> Measurement:
    """Run ``steps`` real optimizer steps of ``job`` at its shape (batch_size x seq_len synthetic
    tokens, one row padded) in a fresh process, as `lodger run` does them, and measure its peak RSS.

    ``pinned_allocator`` (default RUNS_PIN_ALLOCATOR) calls pin_allocator() first, as such a run would."""
    pinned = RUNS_PIN_ALLOCATOR if pinned_allocator is None else pinned_allocator
    spec = {"job": job.model_dump(mode="json"), "folder": str(folder),
            "seq_len": int(seq_len or job.data.max_length), "steps": steps, "pinned": pinned}
    threads = job.training.threads or len(os.sched_getaffinity(0))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        done = subprocess.run([sys.executable, "-c", "from lodger.memory import _measure_child; _measure_child()"],
                              input=json.dumps(spec), capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LodgerError(f"the measurement did not finish within {timeout:.0f} s") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("MEASURED ")]
    if done.returncode != 0 or not lines:
        why = "killed (out of memory?)" if done.returncode in (-9, 137) else f"exit code {done.returncode}"
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise LodgerError(f"the measurement process failed ({why}):\n{tail}")
    return Measurement(**json.loads(lines[-1].removeprefix("MEASURED ")))


def _measure_child() -> None:
    """Body of the measuring process: the pieces of `lodger run`, a few steps, VmHWM."""
    spec = json.loads(sys.stdin.read())
    if spec.get("pinned"):
        pin_allocator()
    import torch

    from .config import JobConfig
    from .model import adapter_files, attach_method, load_base_model, load_tokenizer
    from .train.optim import build_optimizer, optimizer_files
    from .train.precision import Precision
    from .train.step import micro_step, optimizer_step

    job = JobConfig.model_validate(spec["job"])
    cfg = job.training
    torch.set_num_threads(cfg.threads or len(os.sched_getaffinity(0)))
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(cfg.seed)
    phases = {"imports": _proc_status("VmRSS")}
    import_bytes = phases["imports"]
    tokenizer = load_tokenizer(Path(spec["folder"]))
    phases["tokenizer"] = _proc_status("VmRSS")
    model = attach_method(load_base_model(Path(spec["folder"])), job.method, cfg.seed)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if job.method.kind == "lora":
            model.enable_input_require_grads()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg)
    phases["model"] = _proc_status("VmRSS")
    batch_size, seq = cfg.batch_size, spec["seq_len"]
    generator = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(3, len(tokenizer), (batch_size, seq), generator=generator)
    attention = torch.ones(batch_size, seq, dtype=torch.long)
    attention[-1, seq - max(1, seq // 4):] = 0  # real batches are padded: SDPA then keeps a mask
    batch = {"input_ids": ids, "attention_mask": attention,
             "labels": torch.where(attention.bool(), ids, torch.tensor(-100))}
    # The CPU estimate: bf16 autocast stands in for every half precision (fp16 needs a GPU).
    precision = Precision("fp32" if cfg.precision == "fp32" else "bf16", "cpu")
    step_tokens = max(int((batch["labels"] != -100).sum()) * cfg.grad_accum, 1)
    model.train()
    step_peaks, step_seconds = [], []
    for _ in range(spec["steps"]):  # the loop's own step functions (train/step.py)
        started = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float32)
        for _ in range(cfg.grad_accum):
            loss_sum += micro_step(model, batch, precision, "cpu", step_tokens)
        optimizer_step(params, optimizer, precision, cfg.max_grad_norm or math.inf, loss_sum)
        step_seconds.append(time.perf_counter() - started)
        step_peaks.append(_proc_status("VmHWM"))
        phases[f"step{len(step_peaks)}"] = _proc_status("VmRSS")
    phases["file"] = _proc_status("RssFile")
    # A checkpoint as train/checkpointer.py writes it: streamed from the tensors' memory.
    import tempfile

    from .checkpoint import CheckpointStore

    with tempfile.TemporaryDirectory(prefix="lodger-measure-") as scratch:
        saved = CheckpointStore(Path(scratch) / "checkpoints", keep_last=2).save(
            1, {**adapter_files(model, job.method), **optimizer_files(optimizer)})
        phases["checkpoint_bytes"] = sum(f.stat().st_size for f in saved.iterdir())
    phases["after_checkpoint"] = _proc_status("VmHWM")
    print("MEASURED " + json.dumps({"peak_bytes": _proc_status("VmHWM"), "import_bytes": import_bytes,
                                    "step_peaks": step_peaks, "step_seconds": step_seconds,
                                    "phases": phases}), flush=True)
