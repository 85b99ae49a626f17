"""The gate for federated jobs: what will leave each machine, how often, within which limits.

``check(job_path, side, server=...)`` returns a ``FederatedPlan`` or raises FederationRefused
listing every failed check. ``side`` is "client" (`lodger federate JOB --server ADDRESS`: this
owner's machine joins with its dataset) or "server" (`lodger submit JOB --federated`: the
coordinating side runs the app on the SuperLink). What leaves a client each round is the LoRA
adapter (every tensor named, with its shape and bytes), the number of target tokens it trained
on, and a few metrics; the server sends the global adapter, the same tensors, to each client.

Checks: the job has a [federated] section; every limit is declared ([federated] rounds, [remote]
wall_hours, [limits] max_compute_hours: the compute one client gives); secure aggregation's
parameters are ones Flower's SecAgg+ runs and a sum hides one update (secagg.problems); on a
client, every data file is a registered dataset that may federate (owner.py); plain-text
transport only on loopback. Checking writes nothing; ``record`` puts the verdict in the ledger.

No torch, no flwr: shapes come from the model's config.json (memory/model.py's arithmetic).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import FederationRefused, LodgerError

FLOAT32 = 4  # adapter tensors cross the wire as float32 (messages.py)
METRICS = ("train_loss", "target_tokens", "steps")
"""What a client reports with its update each round, besides the tensors."""
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]

    @property
    def bytes(self) -> int:
        n = FLOAT32
        for d in self.shape:
            n *= d
        return n


@dataclass
class FederatedPlan:
    """What an approved federated job sends and may spend, on one side."""

    job_path: Path
    job: Any
    side: str                        # "client" or "server"
    server: str
    dataset: str | None = None       # the client's registered dataset
    tensors: list[Tensor] = field(default_factory=list)
    tensors_unknown: str | None = None

    @property
    def bytes_per_round(self) -> int:
        return sum(t.bytes for t in self.tensors)

    def participation(self) -> str | None:
        from .owner import participation_id

        return participation_id(self.job, self.dataset) if self.dataset else None

    def job_hash(self) -> str:
        from ..config import job_hash

        return job_hash(self.job)

    def limits(self) -> dict[str, Any]:
        return {"rounds": self.job.federated.rounds, "wall_hours": self.job.remote.wall_hours,
                "compute_hours_per_client": self.job.limits.max_compute_hours}

    def masked(self) -> str:
        """How the adapter leaves under SecAgg+ (secagg.py): one masked int64 per value, plus the weight."""
        values = self.bytes_per_round // FLOAT32 + 1
        return (f"as a SecAgg+ masked vector, not in the clear: {values} int64 values, about {8 * values} bytes "
                "(plus keys and encrypted shares: a few hundred bytes per other client)")

    def summary(self) -> dict[str, Any]:
        """The plan as JSON-ready data (printed by --json, recorded with the approval)."""
        from .privacy import mechanism

        fed, training = self.job.federated, self.job.training
        tokens = fed.local_steps * training.batch_size * training.grad_accum * self.job.data.max_length
        return {
            "side": self.side, "job_path": str(self.job_path), "job_hash": self.job_hash(), "server": self.server,
            "dataset": self.dataset, "participation": self.participation(),
            "leaves_each_round": {
                "adapter_tensors": [{"name": t.name, "shape": list(t.shape), "bytes": t.bytes} for t in self.tensors],
                "tensor_count": len(self.tensors), "adapter_bytes": self.bytes_per_round, "dtype": "float32",
                "tensors_unknown_because": self.tensors_unknown,
                "token_count": f"one integer: target tokens trained on (at most {tokens} per round)",
                "metrics": list(METRICS),
                "masked": self.masked() if fed.privacy.secure_aggregation else None,
            },
            "rounds": fed.rounds, "local_steps": fed.local_steps, "min_clients": fed.min_clients,
            "clients_per_round": fed.clients_per_round, "round_timeout_seconds": fed.round_timeout_seconds,
            "limits": self.limits(),
            "privacy": {**fed.privacy.model_dump(mode="json"),
                        "mechanism": mechanism(fed.privacy.model_dump(), max_weight=tokens)},
        }


def adapter_tensors(job, model_config: dict) -> list[Tensor]:
    """The adapter's tensors in peft's naming, in the order peft saves them (layer, module, A then B)."""
    from ..memory.model import model_shape

    shape = model_shape(model_config)
    rank, tensors = job.method.rank, []
    for layer in range(shape.layers):
        for module in job.method.target_modules:
            n_in, n_out = shape.module_dims(module)
            block = "self_attn" if module in _ATTENTION else "mlp"
            base = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors += [Tensor(f"{base}.lora_A.weight", (rank, n_in)), Tensor(f"{base}.lora_B.weight", (n_out, rank))]
    return tensors


def _model_config(job) -> tuple[dict | None, str | None]:
    """config.json of the job's model without loading it (a .gguf not yet prepared has none yet)."""
    from ..model import resolve_source

    source = resolve_source(job.model.source)
    folder = source.path if source.kind != "gguf" else None
    if folder is None:
        from ..home import cache_dir

        folder = cache_dir("models") / source.sha256[:24]
    try:
        return json.loads((folder / "config.json").read_text()), None
    except (OSError, ValueError):
        return None, (f"{job.model.source} has not been prepared on this machine yet, so its shapes are not known "
                      "without loading it; `lodger estimate JOB` prepares it")


def check(job_path: Path, side: str, *, server: str, insecure: bool = False,
          dataset: str | None = None) -> FederatedPlan:
    """Check a federated job for one side; return its plan or raise FederationRefused.

    ``dataset``: the client's registered dataset, in place of the job's `[data] train` (the job
    file is then the same on every machine)."""
    from .owner import load_client_job
    from .processes import check_insecure

    job_path = Path(job_path)
    try:
        job = load_client_job(job_path, dataset if side == "client" else None)
    except LodgerError as exc:
        raise FederationRefused([str(exc)]) from None
    if job.federated is None:
        raise FederationRefused([f"{job_path}: the job has no [federated] section, so it is not a federated job; "
                                 "fix: add [federated] with rounds, local_steps and min_clients (docs/federated.md)"])
    from .owner import job_dataset

    plan = FederatedPlan(job_path.resolve(), job, side, server, dataset=job_dataset(job) if side == "client" else None)
    reasons = _limit_problems(job)
    from .secagg import problems

    reasons += problems(job.federated.privacy.model_dump(), job.federated.model_dump())
    try:
        check_insecure(server, insecure)
    except LodgerError as exc:
        reasons.append(str(exc))
    if side == "client":
        from ..ledger import Ledger
        from .owner import permission_problems

        with Ledger() as ledger:
            reasons += permission_problems(job, ledger)
    try:
        config, plan.tensors_unknown = _model_config(job)
        plan.tensors = adapter_tensors(job, config) if config else []
    except LodgerError as exc:
        reasons.append(str(exc))
    if reasons:
        raise FederationRefused(reasons, plan=plan, job_hash=plan.job_hash())
    return plan


def _limit_problems(job) -> list[str]:
    missing = []
    if job.remote.wall_hours is None:
        missing.append("[remote] wall_hours: missing; a federated job declares how long it may run; fix: add "
                       "`wall_hours = ...` under [remote]")
    if job.limits.max_compute_hours is None:
        missing.append("[limits] max_compute_hours: missing; a federated job declares the CPU hours each client "
                       "gives it; fix: add `max_compute_hours = ...` under [limits]")
    return missing


def record(plan_or_none, job_path: Path, side: str, server: str, *, approved_by: str | None,
           reasons: list[str] | None = None) -> None:
    """`federate_approved` (with the plan and the chain's head before it) or `federate_refused`."""
    from ..ledger import Ledger

    with Ledger() as ledger, ledger.transaction():
        if approved_by is not None:
            summary = plan_or_none.summary()
            ledger.event(None, "federate_approved", approved_by=approved_by, chain_head=ledger.head(), **summary)
        else:
            summary = plan_or_none.summary() if plan_or_none is not None else {}
            ledger.event(None, "federate_refused", side=side, server=server, job_path=str(Path(job_path).resolve()),
                         participation=summary.get("participation"), job_hash=summary.get("job_hash"),
                         reasons=list(reasons or []))
