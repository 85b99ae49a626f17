"""The server's committed rounds: each round's global adapter and aggregation state, with the same
checkpoint contract as a local run (CheckpointStore: files fsynced, MANIFEST.json last, renamed,
folder fsynced; a folder without a valid manifest does not exist).

$LODGER_HOME/federated/<job-id>/
  rounds/step-00000003/   adapter_model.safetensors, adapter_config.json (peft layout), round.json
  adapter/                the newest global adapter as a plain peft folder (written after the commit)

A server killed at any point restarts from the newest round that verifies; a damaged one is moved
aside and the one before it is used.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import durable
from ..checkpoint import CheckpointStore
from ..errors import FederatedError
from ..home import home

ADAPTER = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ROUND_STATE = "round.json"
KEEP_ROUNDS = 1_000_000
"""Every round's global adapter is kept (a LoRA adapter is MiBs): `lodger compare` evaluates each one."""
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def job_folder(job_id: str, root: Path | None = None) -> Path:
    if not JOB_ID.match(job_id or ""):
        raise FederatedError(f"federated job id {job_id!r}: use letters, digits, '_', '.', '-' (at most 128)")
    return Path(root or home()) / "federated" / job_id


@dataclass
class Committed:
    """The newest committed round (round 0: nothing committed yet)."""

    round: int = 0
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    adapter_config: bytes = b""
    state: dict = field(default_factory=dict)


def safetensors_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    from safetensors.numpy import save

    return save({k: np.ascontiguousarray(v) for k, v in sorted(tensors.items())}, metadata={"format": "pt"})


def safetensors_tensors(data: bytes) -> dict[str, np.ndarray]:
    from safetensors.numpy import load

    return dict(load(data))


class RoundStore:
    """Commit and read back the server's rounds for one federated job."""

    def __init__(self, job_id: str, root: Path | None = None, keep_last: int = KEEP_ROUNDS):
        self.folder = job_folder(job_id, root)
        self.store = CheckpointStore(self.folder / "rounds", keep_last=keep_last)

    def latest(self, on_damaged=None) -> Committed:
        self.store.clean_stale()
        ckpt = self.store.latest_good(on_damaged=on_damaged)
        if ckpt is None:
            return Committed()
        state = json.loads(ckpt.files[ROUND_STATE])
        return Committed(ckpt.step, safetensors_tensors(ckpt.files[ADAPTER]), ckpt.files[ADAPTER_CONFIG], state)

    def rounds(self) -> dict[int, Path]:
        """Every committed round's folder, by round number."""
        return dict(self.store.committed())

    def state_of(self, round_no: int) -> dict:
        """Round ``round_no``'s aggregation state (round.json), its manifest and hashes checked."""
        return json.loads(self.store.load_step(round_no).files[ROUND_STATE])

    def tensors_of(self, round_no: int) -> dict[str, np.ndarray]:
        """Round ``round_no``'s global adapter, its manifest and hashes checked."""
        return safetensors_tensors(self.store.load_step(round_no).files[ADAPTER])

    def commit(self, round_no: int, tensors: dict[str, np.ndarray], adapter_config: bytes, state: dict) -> Path:
        """Round ``round_no`` committed (manifest last), then the plain adapter folder refreshed."""
        files = {ADAPTER: safetensors_bytes(tensors), ADAPTER_CONFIG: adapter_config,
                 ROUND_STATE: json.dumps(state, indent=1, sort_keys=True).encode()}
        path = self.store.save(round_no, files, info={"federated_round": round_no})
        durable.write_folder(self.folder / "adapter", {ADAPTER: files[ADAPTER], ADAPTER_CONFIG: adapter_config},
                             tmp_prefix=".adapter-tmp-", replace=True)
        return path
