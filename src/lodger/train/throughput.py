"""What a step's work was worth: model FLOPs per position, this machine's matmul rate, and MFU.

One formula (``token_flops``) serves the step line's model FLOPs utilisation and `lodger
estimate`'s time (memory_model.step_flops feeds it the numbers of config.json; a run feeds it the
numbers of the loaded model). The matmul rate is a 0.2 s benchmark, measured once per machine,
thread count, precision and library version and cached under $LODGER_HOME/cache/matmul/; `lodger
estimate` measures it afresh and refreshes the cache. docs/memory.md has the formula and its limits.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time

from .. import durable
from ..home import cache_dir


def token_flops(matmul: float, trainable_matmul: float, attention_width: float, context: float) -> float:
    """Model FLOPs of one computed position, forward and backward.

    ``matmul``: weights of every matrix multiply (each layer's linears, the LoRA matrices and
    lm_head; the embedding is a lookup); ``trainable_matmul``: those the optimizer updates (all of
    them for full fine-tuning, the LoRA matrices for LoRA); ``attention_width``: q_dim x layers;
    ``context``: the row's width (SDPA computes the whole row's square, padding and causally
    masked halves included). Per position:
      forward 2 x matmul + A, with A = 4 x context x attention_width (q.k^T and the sum over v);
      backward: the inputs' gradients 2 x matmul + 2A, through frozen weights too (LoRA needs them
      to reach the adapters below), and the weights' gradients 2 x trainable_matmul.
    So 6N per token for full fine-tuning, 4N + 2R for LoRA (N matmul weights, R LoRA weights),
    plus 3A. Recomputation under gradient checkpointing is hardware work, not model FLOPs: MFU
    leaves it out (memory_model.step_flops adds it to the time estimate)."""
    attention = 4.0 * context * attention_width
    return 4.0 * matmul + 2.0 * trainable_matmul + 3.0 * attention


def flops_per_second(threads: int | None = None, precision: str = "fp32", seconds: float = 0.2,
                     device: str = "cpu") -> float:
    """Matmul rate of this machine at ``threads`` threads (a ~``seconds`` benchmark) on ``device``."""
    import torch

    from .precision import mode

    dtype = mode(precision).dtype
    before = torch.get_num_threads()
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    cuda = device.startswith("cuda")
    size = 4096 if cuda else 1024  # a GPU needs big matrices to reach its rate
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        # Its own generator: this may run between two training steps, and drawing from the global
        # one would shift every later dropout mask (a run that measured would differ from one that
        # found the rate cached).
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(size // 2, size, dtype=dtype, device=device, generator=g)
        b = torch.randn(size, size, dtype=dtype, device=device, generator=g)
        torch.mm(a, b)  # warm-up: first call picks kernels
        sync()
        flops, started = 0.0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            torch.mm(a, b)
            sync()
            flops += 2.0 * (size // 2) * size * size
        return flops / (time.perf_counter() - started)
    finally:
        torch.set_num_threads(before)


def _rate_file(threads: int, precision: str, device: str):
    import torch

    name = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or platform.machine()
    key = "|".join([torch.__version__, name, str(os.cpu_count()), str(threads), precision, device])
    return cache_dir("matmul") / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def matmul_rate(threads: int, precision: str, device: str = "cpu", *, fresh: bool = False) -> float:
    """The matmul rate MFU is measured against: cached per machine and setting (see the module
    docstring); ``fresh`` measures again and refreshes the cache (what `lodger estimate` does)."""
    memo = _rate_file(threads, precision, device)
    if not fresh and memo.is_file():
        try:
            return float(json.loads(memo.read_text())["flops_per_second"])
        except (ValueError, KeyError, TypeError):
            pass
    rate = flops_per_second(threads, precision, device=device)
    durable.atomic_write(memo, json.dumps({"flops_per_second": rate, "threads": threads,
                                           "precision": precision, "device": device}).encode())
    return rate


class StepWork:
    """The model's numbers for ``token_flops``, counted on the loaded model, and the rate to
    divide by (measured on first use, after a step, so no step is slowed)."""

    def __init__(self, model, *, rows: int, threads: int, precision: str, device: str, world: int = 1):
        import torch

        from .loss import head_parts
        from .precision import mode

        matmul = trainable = 0
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                matmul += module.weight.numel()
                trainable += module.weight.numel() if module.weight.requires_grad else 0
        config = getattr(model, "config", None)
        heads = getattr(config, "num_attention_heads", 0) or 0
        head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) // max(heads, 1))
        self.matmul, self.trainable = matmul, trainable
        # Where the loss runs the head on labelled positions only (loss.py), those are its FLOPs.
        parts = None if mode(precision).autocast else head_parts(model)
        self.head = parts[1].weight.numel() if parts else 0
        self.head_trainable = self.head if parts and parts[1].weight.requires_grad else 0
        self.world = max(1, world)
        self.attention_width = heads * head_dim * (getattr(config, "num_hidden_layers", 0) or 0)
        self.rows = max(1, rows)  # micro-batch rows per step on this rank: computed / rows = mean width
        self.threads, self.precision, self.device = threads, precision, device
        self.rate: float | None = None

    def flops(self, computed: int, padded: int, targets: int = 0, attended: int = 0) -> float:
        """Model FLOPs of a step's real (non-padding) positions, attention over the keys their
        kernels computed (``attended``: PackedBatch.attended; 0: the mean row width); the head's
        only at its ``targets`` (this rank's labelled positions) when the loss skips the rest
        (loss.py)."""
        real = computed - padded
        context = attended / real if attended and real > 0 else computed / self.rows
        body = token_flops(self.matmul - self.head, self.trainable - self.head_trainable, self.attention_width,
                           context)
        head = token_flops(self.head, self.head_trainable, 0.0, 0.0)
        return real * body + (min(targets, real) if self.head else real) * head

    def mfu(self, computed: int, padded: int, seconds: float, tokens: int = 0, attended: int = 0) -> float | None:
        """Model FLOPs utilisation of a step: its model FLOPs over its time, against the matmul
        rate. ``tokens``: the step's target tokens, every rank's."""
        if computed <= 0 or seconds <= 0 or not self.matmul:
            return None
        if self.rate is None:
            self.rate = matmul_rate(self.threads, self.precision, self.device)
        return self.flops(computed, padded, tokens // self.world, attended) / seconds / self.rate
