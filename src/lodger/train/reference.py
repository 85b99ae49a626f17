"""The reference of DPO and KTO: the model as it is at step 0, whose log-probabilities of every
example's sequences are computed once, before step 1, and kept.

Why once: the reference never changes, so its log-probabilities are a fixed table (two floats an
example). Computing them up front needs no second copy of the weights, for LoRA or full
fine-tuning (the model at step 0 is the reference), and no reference forward pass in any step.
The table is cached under $LODGER_HOME/cache/reference/, keyed by what determines it (data,
model, tokenizer, max_length, objective, KTO's KL blocks, device and precision), so a reproduce
or a second run of the same data reuses it; and it is part of every checkpoint
(``reference.safetensors``, hashed in the manifest), so a resume uses the very numbers the run
began with, whatever the cache holds by then.

Computed in eval mode (no dropout), without gradients, one padded batch of [training] batch_size
examples at a time in index order: no randomness drawn, the same numbers every time on the same
machine. A release or hold during the pass is answered (it is only the model's forward).
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from .. import durable
from ..home import cache_dir
from .objective import sequence_logps

if TYPE_CHECKING:
    from ..data.preference import PreferenceSet
    from .precision import Precision

# ``prepared`` below: the run's Prepared (what it trains on), typed where the run lifecycle defines it.

FORMAT_VERSION = 1


def cache_key(dataset_sha: str, prepared: Any, device: str) -> str:
    job = prepared.job
    parts = [FORMAT_VERSION, dataset_sha, prepared.source.sha256, prepared.tokenizer_sha, job.data.max_length,
             job.method.objective, job.training.batch_size if job.method.objective == "kto" else 0, device,
             job.training.precision]
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:32]


@torch.no_grad()
def compute(model: torch.nn.Module, dataset: PreferenceSet, *, batch_size: int, precision: Precision, device: str,
            pad_id: int) -> torch.Tensor:
    """[examples, 2] float32: each example's summed completion log-probabilities under ``model``
    (pairs: chosen, rejected; KTO: the completion, its KL sequence)."""
    from ..data.packing import padded_batch

    out = torch.zeros((len(dataset), 2), dtype=torch.float32)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(dataset), batch_size):
            indices = list(range(start, min(start + batch_size, len(dataset))))
            batch = padded_batch(dataset, indices, pad_id)
            tensors = {k: v.to(device) for k, v in batch.tensors.items()}
            with precision.autocast():
                logps, _ = sequence_logps(model, tensors, batch.sequences)
                if dataset.per_example == 1:  # KTO: the completion, then its KL sequence
                    kl = {k[3:]: v for k, v in tensors.items() if k.startswith("kl_")}
                    logps = torch.cat([logps, sequence_logps(model, kl, batch.sequences)[0]])
            out[start:start + len(indices)] = logps.float().cpu().reshape(2, -1).T
    finally:
        model.train(was_training)
    return out


def ready(model: torch.nn.Module, prepared: Any, *, precision: Precision, device: str, pad_id: int,
          say: Callable[[str], None]) -> None:
    """Give the train and eval sets their reference table (from the cache, or computed and cached)
    unless a checkpoint already did; ``say(text)`` reports what is done."""
    from safetensors.torch import load, save

    sets = [(prepared.train_set, prepared.train_file.sha256)]
    if prepared.eval_set is not None and prepared.eval_set is not prepared.train_set:
        sets.append((prepared.eval_set, prepared.eval_file.sha256))
    for dataset, sha in sets:
        if dataset.reference is not None:
            continue
        path = cache_dir("reference") / f"{cache_key(sha, prepared, device)}.safetensors"
        if path.is_file():
            try:
                table = load(path.read_bytes())["reference"]
                if table.shape == (len(dataset), 2) and bool(torch.isfinite(table).all()):
                    dataset.reference = table
                    continue
            except Exception:  # a damaged cache is computed again, never trusted
                pass
        began = time.monotonic()
        say(f"computing the reference log-probabilities of {len(dataset)} examples (once; cached)")
        dataset.reference = compute(model, dataset, batch_size=prepared.job.training.batch_size,
                                    precision=precision, device=device, pad_id=pad_id)
        durable.atomic_write(path, save({"reference": dataset.reference}))
        say(f"reference log-probabilities ready ({time.monotonic() - began:.1f} s)")
