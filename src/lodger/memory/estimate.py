"""The estimator: peak memory and time of a training job, from the model's config.json.

``estimate`` adds up items (runtime, weights, gradients, optimizer, activations, logits, autocast
copies, checkpoint, buffers, allocator) from the model's shape (``memory/model.py``), the
precision table (``train/precision.py``) and constants calibrated on real steps measured in a
fresh process (``measure``). docs/memory.md says what each item counts and how each constant was
measured; ``bench/memory.py`` prints the comparison for SmolLM2.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

# Measurements of this machine and of real steps, re-exported: callers use memory.measure, ...
from .measure import (RUNS_PIN_ALLOCATOR, Measurement, measure, memory_available, pin_allocator,  # noqa: F401
                      runtime_bytes)
# The model's arithmetic, re-exported: callers use memory.model_shape, memory.step_flops, ...
from .model import (Shape, activation_parts, adapter_extras, base_bytes, head_only_loss,  # noqa: F401
                           largest_linear, layer_bytes, logits_bytes, model_shape, quantised_params, step_flops,
                           trainable_params)
from ..train.precision import MASTER_BYTES, MODES, mode
from ..train.throughput import flops_per_second, matmul_rate  # noqa: F401 (callers use memory.*)

if TYPE_CHECKING:
    from ..config import JobConfig

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
GPU_CONTEXT_BYTES = 600 * 2**20     # CUDA context + cuBLAS workspace (uncalibrated: no GPU here)
GPU_ALLOCATOR_FRACTION = 0.10       # caching-allocator fragmentation on GPU (uncalibrated)
# Share of the matmul benchmark's rate a training step reaches (SmolLM2, idle: 0.65-0.7; docs/memory.md).
MATMUL_EFFICIENCY = 0.6
CHECKPOINT_COPIES = 0               # extra memory of writing a checkpoint, x the trainable weights (streamed)
# A quantised base ([method] base_bits; docs/qlora.md): fp32 copies of the largest quantised linear
# alive at once (a dequantised weight in the forward or backward pass), and what quantising as it
# loads leaves resident beyond the runtime and the weights, about the same whatever the model's size
# (the process after loading, less the runtime item and the quantised weights: SmolLM2 30 MiB at 4
# bits, 26 at 8; a 0.97 B synthetic Llama 18 at 4 bits; the tests' tiny Llama 14; docs/qlora.md).
DEQUANT_COPIES = 2
LOAD_RESIDUE = 32 * 2**20
# Dequantising one weight of a quantised base, each time a pass reads it (the forward, the backward,
# and the recomputation under checkpointing), in FLOPs of the estimate's matmul rate (the measured
# rate x MATMUL_EFFICIENCY), so that it scales with the machine: a 2048 x 8192 linear's forward on
# 512 tokens took 1.43 ns (NF4) and 1.34 ns (int8) a weight longer than fp32's beside a 172 GFLOP/s
# matmul rate, 2 threads, an idle machine: 148 and 138 (docs/qlora.md).
DEQUANT_FLOPS = {4: 150.0, 8: 140.0}


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
             flops_per_second: float | None = None, total_steps: int | None = None,  # noqa: F811 (a rate, the keyword callers use)
             pinned_allocator: bool | None = None, mean_width: float | None = None,
             examples: int | None = None) -> Estimate:
    """Peak memory of ``job`` on ``device`` ("cpu": resident set; "cuda": GPU memory).

    ``seq_len`` defaults to [data] max_length (the widest batch); ``runtime_bytes`` to
    ``runtime_bytes()`` on CPU; ``pinned_allocator`` to RUNS_PIN_ALLOCATOR (whether the training
    process pins glibc's mmap threshold). With ``flops_per_second`` (see ``flops_per_second()``) the
    estimate also carries seconds per optimizer step and, when the step count is known, per job,
    at ``mean_width`` computed positions per row (default ``seq_len``: every batch as wide as the widest).
    ``examples``: train and eval examples, for a DPO/KTO run's reference table.
    """
    shape = model_shape(model_config)
    cfg, method = job.training, job.method
    batch, seq = micro_batch_shape(job, int(seq_len or job.data.max_length))
    tokens = batch * seq
    precision = mode(cfg.precision)
    half = precision.autocast
    gpu = device.startswith("cuda")
    total = shape.total_params
    trainable = trainable_params(shape, method)
    weights = base_bytes(shape, getattr(method, "base_bits", None)) + MASTER_BYTES * trainable * (method.kind == "lora")
    gradients, optimizer = MASTER_BYTES * trainable, 2 * MASTER_BYTES * trainable  # AdamW's two moments
    activations = activation_bytes(shape, tokens, seq, method, precision, cfg.gradient_checkpointing)
    quantised = quantisation_items(shape, method)
    head_only = head_only_loss(model_config, bool(half))
    loss = logits_bytes(shape, batch, seq, head_only=head_only, head_trains=method.kind == "full")
    copies = 0.0
    if half:  # one autocast copy of every linear weight (lm_head too, even when tied)
        copies = precision.value_bytes * (shape.layers * shape.layer_linear_params + shape.vocab * shape.hidden)
        copies += precision.value_bytes * trainable if method.kind == "lora" else 0
    mask = batch * seq * seq  # the boolean causal/padding mask, built once per forward
    buffers = BUFFERS_FIXED + mask + (0 if gpu else TOKENIZER_FIXED + TOKENIZER_BYTES_PER_VOCAB * shape.vocab)
    transient = activations + loss + copies + quantised.get("dequantisation", 0.0)  # freed by the end of each step
    # Writing a checkpoint between steps (Session.save_checkpoint): see CHECKPOINT_COPIES.
    checkpoint = 0.0 if gpu else CHECKPOINT_COPIES * MASTER_BYTES * trainable
    if gpu:
        runtime = GPU_CONTEXT_BYTES if runtime_bytes is None else runtime_bytes
        allocator = GPU_ALLOCATOR_FRACTION * transient
        overlap = _not_alive_together(transient, gradients, checkpoint, method.kind)
    else:
        runtime = measured_runtime(threads=cfg.threads) if runtime_bytes is None else runtime_bytes
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
    # DPO/KTO's reference: two fp32 log-probabilities per example, kept by every process. Its pass
    # (before step 1, no gradients) peaks below a training step and needs no copy of the weights.
    reference = {"reference": 2 * 4 * (examples or 0)} if method.objective in ("dpo", "kto") else {}
    if method.objective == "grpo":  # sampling ends before the loss's forward: the larger of the two counts
        reference = grpo_items(shape, job, batch, seq, precision)
        overlap += min(reference["generation"], activations + loss)
    items = {"runtime": runtime, "weights": weights, "gradients": gradients, "optimizer": optimizer,
             "activations": activations, "logits_and_loss": loss, "checkpoint": checkpoint,
             "buffers": buffers, "allocator": allocator, **reference}
    if half:
        items["autocast_copies"] = copies
    items.update(quantised)
    items = {k: int(round(v)) for k, v in items.items()}
    overlap = int(round(overlap))
    total_bytes = sum(items.values()) - overlap
    largest = max((k for k in items if k != "runtime"), key=lambda k: items[k])
    est = Estimate(items=items, trainable_params=trainable, total_params=total, total_bytes=total_bytes,
                   largest=largest, device=device, batch_size=cfg.batch_size, seq_len=seq, overlap_bytes=overlap,
                   _inputs={"model_config": model_config, "runtime_bytes": runtime, "device": device,
                            "pinned_allocator": pinned_allocator, "examples": examples})
    if flops_per_second:
        est.flops_per_step, est.step_seconds, est.job_seconds = estimate_time(
            job, model_config, flops_per_second, seq_len=mean_width or seq, total_steps=total_steps)
    return est


def activation_bytes(shape: Shape, tokens: int, seq: int, method, precision, checkpointing: bool) -> float:
    """What autograd saves for a micro-batch of ``tokens`` (memory.model.activation_parts), the
    gradients of the layer the backward pass is in (``BACKWARD_LAYERS``), and what DoRA or an 8-bit
    base keep beyond plain LoRA (checkpointed: within the one recomputed layer, left out)."""
    saved, recomputed = activation_parts(shape, tokens, seq, method, precision=precision, checkpointing=checkpointing)
    activations = saved + recomputed + BACKWARD_LAYERS * layer_bytes(shape, tokens, seq, method, precision=precision)
    if method.kind == "lora" and not checkpointing:
        activations += adapter_extras(shape, method, tokens, precision)
    return activations


def quantisation_items(shape: Shape, method) -> dict[str, float]:
    """A quantised base's and DoRA's items, in bytes. ``dequantisation``: scratch, none of it kept
    between layers: fp32 copies of the largest quantised linear (``DEQUANT_COPIES``) and DoRA's
    weight norm (the dequantised weight, the adapter's product as a matrix through an identity of
    the input width, their sum) for the widest adapted layer. ``quantised_load``: what loading left
    resident (``LOAD_RESIDUE``)."""
    items = {}
    if getattr(method, "base_bits", None) is not None:
        items["dequantisation"] = DEQUANT_COPIES * 4.0 * largest_linear(shape)
        items["quantised_load"] = float(LOAD_RESIDUE)  # resident, not transient
    if getattr(method, "use_dora", None):
        dims = [shape.module_dims(t) for t in method.target_modules if t not in ("lm_head", "embed_tokens")]
        items["dequantisation"] = items.get("dequantisation", 0.0) + max(
            (3 * 4.0 * n_in * n_out + 4.0 * n_in * n_in for n_in, n_out in dims), default=0.0)
    return items


def micro_batch_shape(job: "JobConfig", seq: int) -> tuple[int, int]:
    """(rows, positions) of a micro-batch whose longest example is ``seq`` tokens: a preference
    pair is two sequences (KTO one, its KL forward keeping nothing); a GRPO prompt is G completions
    as long as they may get (the widest step)."""
    if job.method.objective == "grpo" and job.grpo is not None:
        return job.training.batch_size * job.grpo.num_generations, seq + job.grpo.max_completion_length
    return job.training.batch_size * sequences_per_example(job.method), seq


def grpo_items(shape: Shape, job: "JobConfig", rows: int, seq: int, precision) -> dict[str, float]:
    """GRPO's own items, in bytes, for micro-batches of ``rows`` completions ``seq`` positions wide
    (prompt and completion). ``generation``: the KV cache (keys and values of every layer, in the
    compute dtype) and one decode step's logits, their processed copy and the sampling
    probabilities. ``rollouts``: each micro-batch's laid-out rows (ids and attention as int64, the
    loss mask, the log-probabilities at sampling time and under the reference, fp32) for the whole
    step, and with num_iterations > 1 until the next sampling. ``reference_model``: full
    fine-tuning with a KL term keeps a frozen fp32 copy of the base."""
    grpo = job.grpo
    assert grpo is not None
    kv = 2 * shape.layers * shape.kv_dim * rows * seq * precision.value_bytes
    decode = 3 * rows * shape.vocab * 4
    per_position = 8 + 8 + 4 + (4 if grpo.num_iterations > 1 else 0) + (4 if grpo.beta > 0 else 0)
    items = {"generation": kv + decode, "rollouts": per_position * rows * seq * job.training.grad_accum}
    if job.method.kind == "full" and grpo.beta > 0:
        items["reference_model"] = MASTER_BYTES * shape.total_params
    return items


def sequences_per_example(method) -> int:
    """Sequences a micro-batch trains per example: two for a pair (DPO, ORPO), else one."""
    return 2 if getattr(method, "objective", "sft") in ("dpo", "orpo") else 1


def _not_alive_together(transient: float, gradients: float, checkpoint: float, kind: str) -> float:
    """Bytes of items never alive at the same moment when freed memory is reused at once: the
    backward pass frees activations as it fills the gradients (full fine-tuning), and a checkpoint
    is built between steps, when both are free again."""
    step = max(transient + (gradients if kind == "lora" else 0), gradients)
    return transient + gradients + checkpoint - max(step, checkpoint)



def estimate_time(job: "JobConfig", model_config: dict, flops_per_second: float, *,  # noqa: F811 (a rate)
                  seq_len: int | None = None, total_steps: int | None = None) -> tuple[float, float, float | None]:
    """(flops per step, seconds per optimizer step, seconds for the whole job or None).

    The step count comes from [training] steps, or from ``total_steps`` for epoch-based jobs."""
    flops = step_flops(job, model_config, seq_len=seq_len)
    step = flops / (flops_per_second * MATMUL_EFFICIENCY)
    bits = getattr(job.method, "base_bits", None)
    if bits is not None:  # every quantised weight dequantised once per pass over it
        passes = job.training.grad_accum * (3 if job.training.gradient_checkpointing else 2)
        flops_like = passes * quantised_params(model_shape(model_config)) * DEQUANT_FLOPS[bits]
        step += flops_like / (flops_per_second * MATMUL_EFFICIENCY)
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
                    device=i["device"], pinned_allocator=i["pinned_allocator"], examples=i["examples"])


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


measured_runtime = runtime_bytes  # estimate() has a keyword argument of the same name


def reference_examples(prepared) -> int:
    """Examples whose reference log-probabilities a run keeps (train, and eval when it is its own set)."""
    own_eval = prepared.eval_set is not None and prepared.eval_set is not prepared.train_set
    return len(prepared.train_set) + (len(prepared.eval_set) if own_eval else 0)
