"""[training], [guard] and [checkpoints]: the optimisation, the numeric guards, and how often state is committed."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import Float, Int, Section

class TrainingConfig(Section):
    steps: Int | None = Field(None, ge=1)
    """Number of optimizer steps. Give either `steps` or `epochs`."""
    epochs: Float | None = Field(None, gt=0)
    """Passes over the training data (may be fractional). Give either `steps` or `epochs`."""
    batch_size: Int = Field(4, ge=1)
    """Examples per micro-batch (one forward and backward pass)."""
    grad_accum: Int = Field(1, ge=1)
    """Micro-batches accumulated into one optimizer step; the effective batch is batch_size * grad_accum."""
    learning_rate: Float = Field(2e-4, gt=0, le=1.0)
    """Peak learning rate of AdamW, reached after warmup."""
    warmup_steps: Int = Field(0, ge=0)
    """Steps of linear warmup from 0 to `learning_rate`."""
    min_lr_ratio: Float = Field(0.1, ge=0.0, le=1.0)
    """After warmup the rate follows a cosine down to learning_rate * min_lr_ratio at the end of training."""
    weight_decay: Float = Field(0.0, ge=0.0)
    """AdamW decoupled weight decay."""
    max_grad_norm: Float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: Int = Field(0, ge=0, lt=2**63)
    """Seeds the adapter's initial weights, dropout, the eval split and the data order."""
    threads: Int | None = Field(None, ge=1, le=1024)
    """CPU threads for torch. Left out, lodger uses every core and records the number it chose;
    results are bitwise comparable only at the same thread count."""
    world_size: Int = Field(1, ge=1, le=1024)
    """Training processes, data parallel through torchrun (gloo on CPU, nccl on GPU); each takes
    `batch_size` examples per micro-batch, so one optimizer step sees batch_size * grad_accum *
    world_size examples. Each process uses `threads` threads. A run resumes only with the number
    of processes that wrote its checkpoint."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: `auto` uses the GPU when there is one."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision: `bf16` autocast (CPU or GPU), `fp16` autocast with dynamic loss scaling (GPU
    only). Trainable weights and optimizer state always stay fp32."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: much less memory, about a third more time."""
    eval_every: Int | None = Field(None, ge=1)
    """Evaluate on the held-out set every this many steps (and always at the start and the end)."""
    log_every: Int = Field(1, ge=1)
    """Print the step line every this many steps (every step is still written to metrics.jsonl)."""
    packing: Literal["auto"] | bool = "auto"
    """Padding-free batches: lay each micro-batch's examples into rows of `pack_tokens` tokens
    (by default one row holding the whole micro-batch, no padding at all), with position ids
    restarting per example and attention that never crosses examples. A step holds the same
    examples as unpacked (same step count, same loss per target token); only the padding goes.
    `auto` packs when the unpacked micro-batches would hold padding (1 % on the CPU, where packed
    attention runs per example; 10 % on a GPU; known from the example lengths before training) and the model
    keeps packed examples apart (probed at start); both go in the provenance. `true` always packs; `false` never."""
    order: Literal["shuffle", "length_grouped"] = "shuffle"
    """Which examples share a step: `shuffle` draws them in a seeded random order;
    `length_grouped` draws examples of similar length together (random megabatches of 50 steps'
    examples sorted by length, as the Hugging Face Trainer's `group_by_length`): far less padding
    and shorter attention rows, so faster on uneven data, but each step's examples are no longer a
    uniform sample. Either is a pure function of seed, epoch and position (exact resume); `packing`
    applies to either (docs/packing.md)."""
    pack_tokens: Int | None = Field(None, ge=1)
    """Token budget of one packed row; left out, batch_size x max_length (one row per
    micro-batch, no padding). At least max_length; smaller rows mean several rows per
    micro-batch, padded to the widest, and less attention work per token with dense attention."""

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> "TrainingConfig":
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give either `steps` or `epochs`, not both: remove one of them")
        if self.steps is None and self.epochs is None:
            raise ValueError("give `steps = N` or `epochs = N` in [training]")
        return self


class GuardConfig(Section):
    skip_nonfinite: bool = True
    """Skip the optimizer step (nothing is updated) when the loss or gradient norm is NaN or Inf."""
    max_bad_steps: Int = Field(3, ge=1)
    """After this many skipped steps in a row, roll back to the last good checkpoint."""
    lr_factor: Float = Field(0.5, gt=0, le=1)
    """After a rollback the learning rate is multiplied by this factor."""
    max_rollbacks: Int = Field(3, ge=0)
    """After this many rollbacks the run stops with a report."""
    spike_zscore: Float = Field(6.0, gt=0)
    """A loss this many robust standard deviations (median/MAD) above the recent window is a spike (recorded)."""
    spike_window: Int = Field(50, ge=5)
    """How many recent steps the spike detector looks at."""


class CheckpointConfig(Section):
    every_steps: Int = Field(0, ge=0)
    """Also commit a checkpoint every this many optimizer steps (0, the default: by time, on stop and
    at the end). A number of steps is a guess at a time that depends on the model and machine;
    every_seconds = "auto" makes the choice."""
    every_seconds: Float | Literal["auto"] = "auto"
    """Also commit one when this many seconds have passed since the last (checked at step boundaries);
    0: never by time. "auto" (the default) chooses the interval that loses least: Young/Daly's
    optimum from this run's measured checkpoint cost and the unplanned interruptions (crashes,
    kills, power cuts) this machine's ledger has seen, with a prior of one a day when there is no
    history; re-chosen after each checkpoint and recorded as `checkpoint_interval` events (`lodger
    show` prints it). The default, because a number here is a guess and a wrong guess costs either
    saving time or lost work; every_steps (off by default) adds step-based saves on top."""
    keep_last: Int = Field(3, ge=2)
    """How many committed checkpoints to keep (at least 2, so a damaged newest one has a fallback)."""

    @field_validator("every_seconds", mode="before")
    @classmethod
    def _seconds_or_auto(cls, value: Any) -> Any:
        if value == "auto" and isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
            return float(value)
        raise ValueError('must be "auto" (lodger chooses it), a number of seconds, or 0 for no time-based '
                         'checkpoints (e.g. every_seconds = 600)')
