"""Which device a run trains on, and the settings that make the same inputs give the same bits."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..errors import JobFileError
from .precision import check_device

if TYPE_CHECKING:
    from ..config import JobConfig


def pick_device(job: JobConfig) -> str:
    """`auto` takes the GPU when there is one; asking for one that is not there is an error."""
    import torch

    wanted = job.training.device
    if wanted == "cuda" and not torch.cuda.is_available():
        raise JobFileError("[training] device = \"cuda\": no CUDA device here; use \"auto\" or \"cpu\"")
    device = "cuda" if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()) else "cpu"
    world = job.training.world_size
    if device == "cuda" and world > torch.cuda.device_count():
        raise JobFileError(f"[training] world_size = {world}: data-parallel training takes one GPU per process and "
                           f"this machine has {torch.cuda.device_count()}; lower world_size, or use "
                           "device = \"cpu\"")
    check_device(job.training.precision, device)  # the precision table says which modes need a GPU
    return device


def configure_determinism(device: str) -> None:
    """Same inputs, same bits: deterministic kernels everywhere, and the cuBLAS setting that allows it."""
    import torch

    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # must be set before cuBLAS starts
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    # On CUDA warn_only=True let attention's backward pick non-deterministic kernels: two bf16 runs
    # differed from step 3 on an H200 (docs/gpu.md). Strict there; on the CPU every kernel we use
    # is deterministic and warn_only keeps an unusual op from stopping a run.
    torch.use_deterministic_algorithms(True, warn_only=device != "cuda")
