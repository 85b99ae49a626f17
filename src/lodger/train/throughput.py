"""What a step's work was worth: model FLOPs per position, this machine's matmul rate, and MFU.

One formula (``token_flops``) serves the step line's model FLOPs utilisation and `lodger
estimate`'s time (memory.model.step_flops feeds it the numbers of config.json; a run feeds it the
numbers of the loaded model). The matmul rate is a 0.2 s benchmark, measured once per machine,
thread count, precision and library version and cached under $LODGER_HOME/cache/matmul/ with the
conditions it was measured in (the CPU share other processes took meanwhile, the load average):
a peak measured while something else ran is too low and would put MFU above 100 %, so a busy
measurement is tried again, is never preferred to a quiet one, and is measured anew at its next
use. `lodger estimate` measures it afresh. docs/memory.md has the formula and its limits.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time

from pathlib import Path
from typing import TYPE_CHECKING

from .. import durable
from ..home import cache_dir

if TYPE_CHECKING:
    import torch


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
    leaves it out (memory.model.step_flops adds it to the time estimate)."""
    attention = 4.0 * context * attention_width
    return 4.0 * matmul + 2.0 * trainable_matmul + 3.0 * attention


QUIET_OTHERS = 0.10
"""A measurement is quiet when other processes used under this share of the machine's CPUs
while it ran (``cpu_busy``); the load average lags a minute and counts the run itself."""
TRIES = 3  # measurements while others are busy, the fastest kept


def flops_per_second(threads: int | None = None, precision: str = "fp32", seconds: float = 0.2,
                     device: str = "cpu") -> float:
    """Matmul rate of this machine at ``threads`` threads (a ~``seconds`` benchmark) on ``device``."""
    return measure_once(threads, precision, seconds, device)["flops_per_second"]


def cpu_busy() -> tuple[float, int] | None:
    """(CPU seconds every CPU of the machine has spent busy, steal time included, number of CPUs),
    from psutil (/proc/stat on Linux); None where it cannot tell."""
    try:
        import psutil

        t = psutil.cpu_times()
    except (ImportError, OSError, RuntimeError):
        return None
    # guest time is inside user already; steal is time a VM's host gave to others
    busy = t.user + t.system + sum(getattr(t, name, 0.0) for name in ("nice", "irq", "softirq", "steal"))
    return busy, psutil.cpu_count() or 1


def cores_in_use(seconds: float = 1.0) -> float | None:
    """How many of the machine's CPUs other processes keep busy, sampled over ``seconds`` (this
    process sleeping meanwhile); None where ``cpu_busy`` cannot tell."""
    before, own = cpu_busy(), time.process_time()
    time.sleep(seconds)
    after, own = cpu_busy(), time.process_time() - own
    if not before or not after:
        return None
    return max(0.0, (after[0] - before[0] - own) / seconds)


def measure_once(threads: int | None = None, precision: str = "fp32", seconds: float = 0.2,
                 device: str = "cpu") -> dict:
    """One benchmark: the rate and what else the machine was doing meanwhile (``others``: the
    share of all CPUs other processes used; None where unknown or on a GPU)."""
    import torch

    from .precision import mode

    dtype = mode(precision).dtype
    before = torch.get_num_threads()
    threads = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
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
        busy_before, cpu_before = cpu_busy(), time.process_time()
        flops, started = 0.0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            torch.mm(a, b)
            sync()
            flops += 2.0 * (size // 2) * size * size
        wall = time.perf_counter() - started
        own, busy_after = time.process_time() - cpu_before, cpu_busy()
    finally:
        torch.set_num_threads(before)
    others = None
    if busy_before and busy_after and not cuda:
        # what the machine's CPUs did beyond this process; tick granularity makes it a few % noisy
        others = round(min(1.0, max(0.0, (busy_after[0] - busy_before[0] - own) / (wall * busy_after[1]))), 3)
    return {"flops_per_second": flops / wall, "threads": threads, "precision": precision, "device": device,
            "seconds": round(wall, 3), "others": others, "load": round(os.getloadavg()[0], 2),
            "quiet": others is None or others < QUIET_OTHERS, "measured_at": round(time.time(), 3)}


def measure_rate(threads: int, precision: str, device: str = "cpu", tries: int = TRIES) -> dict:
    """The matmul rate as a peak: measured again (after a pause) while others are busy, up to
    ``tries`` times; the fastest measurement kept, with ``tries`` saying how many it took."""
    best: dict | None = None
    for attempt in range(1, tries + 1):
        found = measure_once(threads, precision, device=device)
        best = found if best is None or better(found, best) else best
        if found["quiet"] or attempt == tries:
            break
        time.sleep(0.5)  # give whatever else runs a moment to finish
    assert best is not None  # tries >= 1
    best["tries"] = attempt
    return best


def better(new: dict, old: dict) -> bool:
    """Whether measurement ``new`` is the better peak: a quiet one beats a busy one, then the faster."""
    return (new["quiet"], new["flops_per_second"]) > (old["quiet"], old["flops_per_second"])


def _rate_file(threads: int, precision: str, device: str) -> Path:
    import torch

    name = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or platform.machine()
    key = "|".join([torch.__version__, name, str(os.cpu_count()), str(threads), precision, device])
    return cache_dir("matmul") / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def rate_record(threads: int, precision: str, device: str = "cpu", *, fresh: bool = False) -> dict:
    """The matmul rate MFU is measured against, with how it was measured (``measure_once``'s fields,
    ``tries``, and ``cached``: whether it came from the cache). A quiet cached measurement is used
    as it is; a busy one is measured again. ``fresh`` measures again whatever the cache holds and
    returns that measurement (what `lodger estimate` and the demo's forecast do). The cache keeps
    the better of the two (``better``)."""
    memo = _rate_file(threads, precision, device)
    cached = None
    try:
        cached = json.loads(memo.read_text())
        float(cached["flops_per_second"])
        cached.setdefault("quiet", False)  # written before conditions were recorded: unknown, measure again
    except (OSError, ValueError, KeyError, TypeError):
        cached = None
    if cached is not None and cached["quiet"] and not fresh:
        return {**cached, "cached": True}
    found = measure_rate(threads, precision, device)
    if cached is None or better(found, cached):
        durable.atomic_write(memo, json.dumps(found).encode())
    elif not fresh:
        return {**cached, "cached": True}  # the cache's is still the better peak
    return {**found, "cached": False}


def matmul_rate(threads: int, precision: str, device: str = "cpu", *, fresh: bool = False) -> float:
    """``rate_record``'s rate alone."""
    return float(rate_record(threads, precision, device, fresh=fresh)["flops_per_second"])


class StepWork:
    """The model's numbers for ``token_flops``, counted on the loaded model, and the rate to
    divide by (measured on first use, after a step, so no step is slowed)."""

    def __init__(self, model: torch.nn.Module, *, rows: int, threads: int, precision: str, device: str, world: int = 1):
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
        self.rate_info: dict | None = None   # how the rate was measured (rate_record)
        self.new_rate: dict | None = None    # ... not yet handed to the recorder
        self.remeasured = False

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
        rate. ``tokens``: the step's target tokens, every rank's. None when unknown, and never above
        1: see below."""
        if computed <= 0 or seconds <= 0 or not self.matmul:
            return None
        if self.rate is None:
            self._take(rate_record(self.threads, self.precision, self.device))
        rate = float(self.rate or 0.0)  # set by _take
        work = self.flops(computed, padded, tokens // self.world, attended) / seconds
        if work > rate and not self.remeasured:
            # A step cannot beat the machine's peak: the rate was measured while something else
            # ran (or the machine got faster since). Measure again, between steps, once a run.
            self.remeasured = True
            found = measure_rate(self.threads, self.precision, self.device)
            if found["flops_per_second"] > rate:
                self._take({**found, "cached": False, "reason": "a step beat the rate"})
                rate = float(found["flops_per_second"])
        # Above 1 the denominator is wrong, not the step fast: a number people would read as the
        # machine's peak being exceeded. Left out (None) rather than shown or recorded.
        return work / rate if work <= rate else None

    def _take(self, record: dict) -> None:
        self.rate, self.rate_info, self.new_rate = float(record["flops_per_second"]), record, record

    def take_new_rate(self) -> dict | None:
        """The rate's record once after it is first known or measured again (for the run's ledger)."""
        record, self.new_rate = self.new_rate, None
        return record
