"""The estimator: peak memory and time of a training job, from the model's config.json.

``estimate`` adds up items (runtime, weights, gradients, optimizer, activations, logits, autocast
copies, checkpoint, buffers, allocator) from the model's shape (``memory_model.py``), the
precision table (``train/precision.py``) and constants calibrated on real steps measured in a
fresh process (``measure``). docs/memory.md says what each item counts and how each constant was
measured; ``bench/memory.py`` prints the comparison for SmolLM2.
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

from .errors import LodgerError
# The model's arithmetic, re-exported: callers use memory.model_shape, memory.step_flops, ...
from .memory_model import (Shape, activation_parts, head_only_loss, layer_bytes, logits_bytes, model_shape,  # noqa: F401
                           step_flops, trainable_params)
from .train.precision import MASTER_BYTES, MODES, mode
from .train.throughput import flops_per_second, matmul_rate  # noqa: F401 (callers use memory.*)

if TYPE_CHECKING:
    from .config import JobConfig

GiB = 2**30

# -- calibrated constants ---------------------------------------------------------------------
TOKENIZER_FIXED = int(2.5 * 2**20)   # a loaded fast tokenizer: its first template and tables
TOKENIZER_BYTES_PER_VOCAB = 940     # ... and per vocabulary entry (SmolLM2, 49,152 entries: 46 MB)
BUFFERS_FIXED = 8 * 2**20           # model-independent scratch: autograd engine, kernels' workspaces
# Share of a step's transient bytes glibc keeps resident (its dynamic mmap threshold): docs/memory.md.
ALLOCATOR_RETAINED = 0.5
# glibc's mmap threshold never rises above this (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit): bigger blocks
# (the logits of most batches) are mappings of their own, returned to the system when freed.
MMAP_THRESHOLD_MAX = 32 * 2**20
# Gradients of one layer's activations alive while the backward pass is inside it, x that layer's
# saved bytes (docs/memory.md): what makes the peak of few-layer models more than their activations.
BACKWARD_LAYERS = 0.75
# Whether `lodger run` pins the mmap threshold (pin_allocator): it does not; slower steps (docs/memory.md).
RUNS_PIN_ALLOCATOR = False
GPU_CONTEXT_BYTES = 600 * 2**20     # CUDA context + cuBLAS workspace (uncalibrated: no GPU here)
GPU_ALLOCATOR_FRACTION = 0.10       # caching-allocator fragmentation on GPU (uncalibrated)
# Share of the matmul benchmark's rate a training step reaches (SmolLM2, idle: 0.65-0.7; docs/memory.md).
MATMUL_EFFICIENCY = 0.6
CHECKPOINT_COPIES = 0               # extra memory of writing a checkpoint, x the trainable weights (streamed)


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
             pinned_allocator: bool | None = None, mean_width: float | None = None) -> Estimate:
    """Peak memory of ``job`` on ``device`` ("cpu": resident set; "cuda": GPU memory).

    ``seq_len`` defaults to [data] max_length (the widest batch); ``runtime_bytes`` to
    ``runtime_bytes()`` on CPU; ``pinned_allocator`` to RUNS_PIN_ALLOCATOR (whether the training
    process pins glibc's mmap threshold). With ``flops_per_second`` (see ``flops_per_second()``) the
    estimate also carries seconds per optimizer step and, when the step count is known, per job,
    at ``mean_width`` computed positions per row (default ``seq_len``: every batch as wide as the widest).
    """
    shape = model_shape(model_config)
    cfg, method = job.training, job.method
    seq = int(seq_len or job.data.max_length)
    batch = cfg.batch_size
    tokens = batch * seq
    precision = mode(cfg.precision)
    half = precision.autocast
    gpu = device.startswith("cuda")
    total = shape.total_params
    trainable = trainable_params(shape, method)

    weights = MASTER_BYTES * (total + (trainable if method.kind == "lora" else 0))
    gradients = MASTER_BYTES * trainable
    optimizer = 2 * MASTER_BYTES * trainable  # AdamW's two moments
    saved, recomputed = activation_parts(shape, tokens, seq, method, precision=precision,
                                         checkpointing=cfg.gradient_checkpointing)
    activations = saved + recomputed + BACKWARD_LAYERS * layer_bytes(shape, tokens, seq, method, precision=precision)
    head_only = head_only_loss(model_config, bool(half))
    loss = logits_bytes(shape, batch, seq, head_only=head_only, head_trains=method.kind == "full")
    copies = 0.0
    if half:  # one autocast copy of every linear weight (lm_head too, even when tied)
        copies = precision.value_bytes * (shape.layers * shape.layer_linear_params + shape.vocab * shape.hidden)
        copies += precision.value_bytes * trainable if method.kind == "lora" else 0
    mask = batch * seq * seq  # the boolean causal/padding mask, built once per forward
    buffers = BUFFERS_FIXED + mask + (0 if gpu else TOKENIZER_FIXED + TOKENIZER_BYTES_PER_VOCAB * shape.vocab)
    transient = activations + loss + copies       # freed again by the end of each step
    # Writing a checkpoint between steps (Session.save_checkpoint): see CHECKPOINT_COPIES.
    checkpoint = 0.0 if gpu else CHECKPOINT_COPIES * MASTER_BYTES * trainable
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
            block = min(loss, 4 * tokens * shape.vocab)  # the largest logits block (a chunk: loss.py)
            heap = transient - (loss if block >= MMAP_THRESHOLD_MAX else 0.0)
            allocator = max(0.0, ALLOCATOR_RETAINED * heap - gradients)
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
            job, model_config, flops_per_second, seq_len=mean_width or seq, total_steps=total_steps)
    return est


def _not_alive_together(transient: float, gradients: float, checkpoint: float, kind: str) -> float:
    """Bytes of items never alive at the same moment when freed memory is reused at once: the
    backward pass frees activations as it fills the gradients (full fine-tuning), and a checkpoint
    is built between steps, when both are free again."""
    step = max(transient + (gradients if kind == "lora" else 0), gradients)
    return transient + gradients + checkpoint - max(step, checkpoint)



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
    if not mode(cfg.precision).autocast:  # the half-precision mode that runs anywhere
        half_mode = next(m.name for m in MODES.values() if m.autocast and not m.needs_gpu)
        options.append((f'[training] precision = "{half_mode}"', {"training": {"precision": half_mode}}, None))
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
            timeout: float | None = None, pinned_allocator: bool | None = None, packed: bool = False) -> Measurement:
    """Run ``steps`` real optimizer steps of ``job`` at its shape (batch_size x seq_len synthetic
    tokens, one row padded) in a fresh process, as `lodger run` does them, and measure its peak RSS.

    ``pinned_allocator`` (default RUNS_PIN_ALLOCATOR) calls pin_allocator() first, as such a run would.
    ``packed``: rows of two examples each, as packing.collate_packed makes them (no attention_mask)."""
    pinned = RUNS_PIN_ALLOCATOR if pinned_allocator is None else pinned_allocator
    spec = {"job": job.model_dump(mode="json"), "folder": str(folder),
            "seq_len": int(seq_len or job.data.max_length), "steps": steps, "pinned": pinned, "packed": packed}
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
    if spec.get("packed"):  # two examples per row, positions restarting, attention per example as a run has it
        from .train.attention import set_attention

        set_attention(model)
        half = max(1, seq // 2)
        positions = (torch.arange(seq) % half).expand(batch_size, seq).clone()
        batch = {"input_ids": ids, "position_ids": positions,
                 "labels": torch.where(positions == 0, torch.tensor(-100), ids)}
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
