"""Compute precision: one table of modes, and ``Precision``, which applies a mode to a training step.

Every fact about a precision lives in ``MODES``: its torch dtype, whether it needs a GPU, the
bytes of one value (activations and autocast's weight copies), the autocast dtype and whether the
loss is scaled. The device choice (``check_device``), the gate and the estimator read it; a new
precision is one more row. Trainable weights and optimizer state stay fp32 in every mode
(``MASTER_BYTES``); only the forward pass is autocast.

No torch at import: the gate and the estimator read the table without it.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager

from ..errors import JobFileError

if TYPE_CHECKING:
    import torch

MASTER_BYTES = 4  # weights, gradients and each AdamW moment: fp32 whatever the mode


@dataclass(frozen=True)
class Mode:
    """One precision mode, as `[training] precision` names it."""

    name: str
    dtype_name: str          # the torch dtype of its values, by name (torch is imported lazily)
    value_bytes: int         # bytes of one value in that dtype: saved activations, autocast's weight copies
    autocast: bool           # whether the forward pass runs under autocast (and casts every linear weight)
    needs_gpu: bool          # whether it runs only on a GPU
    loss_scaling: bool       # dynamic loss scaling (GradScaler), against small gradients flushing to zero
    why_gpu: str = ""        # why it needs a GPU, for the error that says so
    cpu_instead: str = ""    # the mode to use on a CPU instead

    @property
    def dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def autocast_dtype(self) -> "torch.dtype | None":
        return self.dtype if self.autocast else None


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("fp32", "float32", 4, autocast=False, needs_gpu=False, loss_scaling=False),
    # bf16 has fp32's range: no loss scaling, and CPUs run it
    Mode("bf16", "bfloat16", 2, autocast=True, needs_gpu=False, loss_scaling=False),
    Mode("fp16", "float16", 2, autocast=True, needs_gpu=True, loss_scaling=True,
         why_gpu="loss scaling is a GPU feature", cpu_instead="bf16"),
)}


def mode(name: str) -> Mode:
    """The mode named ``name``; an unknown name is a job file error listing the known ones."""
    try:
        return MODES[name]
    except KeyError:
        raise JobFileError(f"[training] precision = {name!r}: unknown; use one of "
                           f"{', '.join(repr(m) for m in MODES)}") from None


def check_device(name: str, device: str) -> None:
    """Refuse a mode that needs a GPU on ``device`` ("cpu", "cuda", "cuda:1")."""
    m = mode(name)
    if m.needs_gpu and device.split(":")[0] != "cuda":
        raise JobFileError(f"[training] precision = \"{m.name}\" needs a GPU ({m.why_gpu}); "
                           f"use \"{m.cpu_instead}\" on the CPU")


class Precision:
    def __init__(self, mode_name: str, device: str):
        import torch

        self.mode, self.device_type = mode_name, device.split(":")[0]
        self.dtype = mode(mode_name).autocast_dtype
        # Loss scaling keeps small fp16 gradients from flushing to zero; bf16 has fp32's range.
        self.scaler = torch.amp.GradScaler("cuda") if mode(mode_name).loss_scaling else None

    def autocast(self) -> ContextManager[Any]:
        import torch

        return torch.autocast(self.device_type, dtype=self.dtype) if self.dtype else nullcontext()

    def backward(self, loss: "torch.Tensor") -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: "torch.optim.Optimizer") -> None:
        """Bring gradients back to their true size before clipping and the finite check."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: "torch.optim.Optimizer") -> None:
        if self.scaler:
            self.scaler.step(optimizer)  # skips the update itself if the gradients overflowed
            self.scaler.update()
        else:
            optimizer.step()

    def skip(self) -> None:
        """A step whose loss or gradients were not finite is skipped: the scaler must still close
        its step (``unscale_`` was called) and lower its scale, or the next step's ``unscale_`` raises."""
        if self.scaler:
            self.scaler.update()

    def state(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
