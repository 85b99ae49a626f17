"""Compute precision: fp32, bf16 autocast (CPU or GPU), fp16 autocast with dynamic loss scaling (GPU).

Trainable weights and optimizer state stay fp32 in every mode; only the forward pass is autocast.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch


class Precision:
    def __init__(self, mode: str, device: str):
        self.mode, self.device_type = mode, device.split(":")[0]
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)
        # Loss scaling keeps small fp16 gradients from flushing to zero; bf16 has fp32's range.
        self.scaler = torch.amp.GradScaler("cuda") if mode == "fp16" else None

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype) if self.dtype else nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer) -> None:
        """Bring gradients back to their true size before clipping and the finite check."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer) -> None:
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
