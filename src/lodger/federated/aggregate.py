"""FedAvg of LoRA adapters, weighted by target tokens, bitwise reproducible.

Why not Flower's FedAvg strategy: its mean runs in the order replies arrive, in the tensors' own
precision, so two runs with the same clients can differ in the last bit. Here the replies are
sorted by client id and summed in float64 (each weighted tensor ``w_i * x_i`` with
``w_i = tokens_i / total``), then cast back to the tensor's dtype once: the same inputs give the
same bytes whatever order they arrived in. With one client the weight is exactly 1.0 and the
float32 -> float64 -> float32 trip is exact, so the aggregate is that client's adapter bit for bit.

numpy only (no torch): the server side needs no model and no training stack.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ..errors import FederatedError


@dataclass
class Update:
    """One client's reply for a round: its adapter tensors and how many target tokens it trained on."""

    client_id: str
    tokens: int
    tensors: dict[str, np.ndarray]


def tensors_sha256(tensors: dict[str, np.ndarray]) -> str:
    """A content hash of named tensors: sha256 over (name, dtype, shape, bytes) in name order.

    Both sides compute it on the tensors themselves, so it names the same content whatever the wire
    encoding was."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}\0{array.dtype.str}\0{list(array.shape)}\0".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def tensors_bytes(tensors: dict[str, np.ndarray]) -> int:
    """Payload bytes of named tensors (what an adapter costs on the wire, framing aside)."""
    return int(sum(np.asarray(t).nbytes for t in tensors.values()))


def check_same_layout(updates: list[Update], reference: dict[str, np.ndarray] | None = None) -> None:
    """Every update has the same names, shapes and dtypes (and those of ``reference`` when given)."""
    layout = {k: (v.shape, v.dtype.str) for k, v in (reference or updates[0].tensors).items()}
    for update in updates:
        theirs = {k: (v.shape, v.dtype.str) for k, v in update.tensors.items()}
        if theirs != layout:
            extra, missing = sorted(set(theirs) - set(layout)), sorted(set(layout) - set(theirs))
            changed = sorted(k for k in set(theirs) & set(layout) if theirs[k] != layout[k])
            raise FederatedError(f"client {update.client_id!r} sent an adapter of another layout (extra "
                                 f"{extra[:3]}, missing {missing[:3]}, other shape/dtype {changed[:3]}); "
                                 "its reply is refused: every client must train the job's [method]")


def fedavg(updates: list[Update], reference: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The token-weighted mean of the updates' tensors, in client-id order, accumulated in float64."""
    if not updates:
        raise FederatedError("no client updates to aggregate")
    ids = [u.client_id for u in updates]
    if len(set(ids)) != len(ids):
        raise FederatedError(f"two replies claim the same client id in one round: {sorted(ids)}")
    if any(u.tokens <= 0 for u in updates):
        raise FederatedError(f"a client reported no target tokens: {[(u.client_id, u.tokens) for u in updates]}")
    check_same_layout(updates, reference)
    ordered = sorted(updates, key=lambda u: u.client_id)
    total = float(sum(u.tokens for u in ordered))
    out: dict[str, np.ndarray] = {}
    for name in sorted(ordered[0].tensors):
        acc = np.zeros(ordered[0].tensors[name].shape, dtype=np.float64)
        for update in ordered:
            acc += np.asarray(update.tensors[name], dtype=np.float64) * (update.tokens / total)
        out[name] = acc.astype(ordered[0].tensors[name].dtype)
    return out
