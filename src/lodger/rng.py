"""Capture and restore every random number generator, without pickle.

Tensors (torch CPU and CUDA states) go into a safetensors file; Python's and NumPy's states are
plain JSON.
"""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch


def capture() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Return (tensors, json_state) describing every RNG right now."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{index}"] = state
    version, internal, gauss = random.getstate()
    # legacy=True (the default): the tuple form, which numpy's stubs do not tell from the dict form
    kind, keys, pos, has_gauss, cached = cast(tuple[str, Any, int, int, float], np.random.get_state())
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    return tensors, state


def restore(tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
    """Put every RNG back exactly as ``capture`` saw it."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        cuda_states = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def to_json(tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> dict[str, Any]:
    """``capture()``'s result as plain JSON (tensor states as base64 bytes): another rank's RNG file."""
    import base64

    encoded = {k: base64.b64encode(v.cpu().numpy().tobytes()).decode() for k, v in tensors.items()}
    return {**state, "tensors": encoded}


def from_json(data: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The inverse of ``to_json``: (tensors, json_state) for ``restore``."""
    import base64

    tensors = {k: torch.frombuffer(bytearray(base64.b64decode(v)), dtype=torch.uint8).clone()
               for k, v in data["tensors"].items()}
    return tensors, {k: v for k, v in data.items() if k != "tensors"}
