"""The planner: the settings that make a job fit a memory limit (`lodger plan JOB --memory 16GiB`).

It varies what changes the memory a step needs and not what the job learns, then what does:
the base's precision ([method] base_bits: fp32, 8, 4), gradient checkpointing, the micro-batch
(batch_size down, grad_accum up: the same examples per optimizer step), and last the longest
example ([data] max_length, halved: longer examples are cut). Every combination is estimated
(memory.estimate: arithmetic over the model's shape, nothing loaded) with its predicted peak and
time per step; those that fit are ranked (no cut first, then the fastest), and the chosen one is
written as a new job file. Nothing fits: ``PlanRefused`` says by how much the smallest misses.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import JobFileError, PlanRefused

if TYPE_CHECKING:
    from ..config import JobConfig
    from .estimate import Estimate

GiB = 2**30
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": GiB, "gib": GiB, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}
SHORTEST = 64  # max_length is never planned below this


def parse_size(text: str) -> int:
    """"16GiB", "16G", "1.5 TiB", "800MiB", "16GB" (decimal) to bytes; a bare number is GiB."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise JobFileError(f"--memory {text!r}: not a size; write it as e.g. 16GiB, 800MiB or 16GB")
    return int(float(match.group(1)) * (_UNITS[unit] if unit else GiB))


@dataclass
class Option:
    """One setting the planner considered: what it changes in the job, and its estimate."""

    changes: dict[str, dict[str, Any]]
    estimate: "Estimate"
    cuts: bool = False       # a shorter max_length: changes what is learnt
    fits: bool = False
    notes: list[str] = field(default_factory=list)

    def describe(self, job: "JobConfig") -> str:
        """The setting in the job's words: `4-bit base, checkpointing, batch 2 x accum 4, max_length 128`."""
        method, training, data = (self.changes.get(s, {}) for s in ("method", "training", "data"))
        bits = method.get("base_bits", job.method.base_bits)
        gc = training.get("gradient_checkpointing", job.training.gradient_checkpointing)
        batch = training.get("batch_size", job.training.batch_size)
        accum = training.get("grad_accum", job.training.grad_accum)
        length = data.get("max_length", job.data.max_length)
        return (f"{f'{bits}-bit' if bits else 'fp32'} base, checkpointing {'on' if gc else 'off'}, batch {batch} x "
                f"accum {accum}, max_length {length}")


def apply(job: "JobConfig", changes: dict[str, dict[str, Any]]) -> "JobConfig":
    """A copy of ``job`` with some [section] keys changed, validated as a job file would be."""
    from ..config import JobConfig

    data = job.model_dump(mode="python")
    for section, values in changes.items():
        data[section] = {**data[section], **values}
    changed = JobConfig.model_validate(data)
    changed.attach_data_uses(job.data_uses())
    return changed


def candidates(job: "JobConfig", longest: int) -> list[tuple[dict[str, dict[str, Any]], bool]]:
    """Every combination of the settings the planner may change, as ([section] changes, cuts):
    the current values and the ones that need less memory."""
    method, training = job.method, job.training
    bits: list[int | None] = [method.base_bits]
    if method.kind == "lora" and job.federated is None and training.world_size == 1:
        bits += [b for b in (8, 4) if method.base_bits is None or b < method.base_bits]
    effective = training.batch_size * training.grad_accum
    batches = [b for b in range(training.batch_size, 0, -1) if effective % b == 0]
    lengths = [longest]
    while lengths[-1] // 2 >= SHORTEST:
        lengths.append(lengths[-1] // 2)
    found = []
    for b, gc, batch, length in itertools.product(bits, sorted({training.gradient_checkpointing, True}), batches,
                                                  lengths):
        changes: dict[str, dict[str, Any]] = {}
        if b != method.base_bits:
            changes["method"] = {"base_bits": b}
        if gc != training.gradient_checkpointing:
            changes["training"] = {"gradient_checkpointing": gc}
        if batch != training.batch_size:
            changes.setdefault("training", {}).update(batch_size=batch, grad_accum=effective // batch)
        if length != longest:
            changes["data"] = {"max_length": length}
        found.append((changes, length != longest))
    return found


def plan(job: "JobConfig", model_config: dict, budget: int, *, longest: int, runtime_bytes: int | None,
         device: str, flops_per_second: float | None, examples: int | None = None,
         mean_width: float | None = None) -> list[Option]:
    """Every candidate estimated, those that fit first, ranked: no cut, then the fastest step (the
    same examples per step whatever the micro-batch), then the fewest changes and the smallest peak. ``longest``: the
    longest example's width (at most max_length), as `lodger estimate` takes it."""
    from . import estimate as memory

    options = []
    for changes, cuts in candidates(job, longest):
        changed = apply(job, changes)
        seq = min(longest, changed.data.max_length)
        est = memory.estimate(changed, model_config, seq_len=seq, runtime_bytes=runtime_bytes, device=device,
                              flops_per_second=flops_per_second, examples=examples,
                              mean_width=min(mean_width or seq, seq))
        options.append(Option(changes, est, cuts, est.total_bytes <= budget))
    changed = lambda o: sum(len(v) for v in o.changes.values())  # noqa: E731 (a sort key)
    return sorted(options, key=lambda o: (not o.fits, o.cuts, round(o.estimate.step_seconds or 0.0, 3), changed(o),
                                          o.estimate.total_bytes))


def refuse_if_none_fits(options: list[Option], job: "JobConfig", budget: int) -> None:
    """Raise PlanRefused, saying by how much the smallest setting misses, when nothing fits."""
    if any(o.fits for o in options):
        return
    smallest = min(options, key=lambda o: o.estimate.total_bytes)
    need = smallest.estimate.total_bytes
    raise PlanRefused(f"nothing the planner may change makes this job fit in {budget / GiB:.2f} GiB: the smallest "
                      f"setting ({smallest.describe(job)}) needs an estimated {need / GiB:.2f} GiB, "
                      f"{(need - budget) / GiB:.2f} GiB over (largest item: {smallest.estimate.largest}, "
                      f"{smallest.estimate.items[smallest.estimate.largest] / GiB:.2f} GiB). Use a smaller model, "
                      "a lower [method] rank or fewer target_modules, or a machine with more memory")


def write_job(original: Path, out: Path, changes: dict[str, dict[str, Any]]) -> Path:
    """The user's job file as written (user defaults not folded in) with ``changes`` applied, to
    ``out``; relative data paths are made absolute when ``out`` is in another folder."""
    from .. import durable
    from ..config import read_toml
    from ..config.tomlfile import to_toml

    raw = read_toml(original, "job file")
    for section, values in changes.items():
        raw[section] = {**raw.get(section, {}), **{k: v for k, v in values.items() if v is not None}}
        for key in [k for k, v in values.items() if v is None]:  # back to the default (base_bits: fp32)
            raw[section].pop(key, None)
    if out.resolve().parent != original.resolve().parent:
        data = raw.get("data", {})
        for key in ("train", "eval"):
            if isinstance(data.get(key), str) and not data[key].startswith("dataset:") and not Path(data[key]).is_absolute():
                data[key] = str((original.resolve().parent / data[key]).resolve())
        source = raw.get("model", {}).get("source")
        if isinstance(source, str) and (original.resolve().parent / source).exists() and not Path(source).is_absolute():
            raw["model"]["source"] = str((original.resolve().parent / source).resolve())
    durable.atomic_write(out, to_toml(raw).encode())
    return out
