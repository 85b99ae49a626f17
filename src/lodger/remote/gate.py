"""The gate between this machine and remote compute: what `lodger submit` checks before anything leaves.

``check(job, target)`` either returns a ``Plan`` (every file that would leave, with size and
sha256; the memory and time estimate on the target; the most it may cost) or raises
``GateRefused`` listing every failed check, not only the first:

* data: every data file is a registered dataset whose content is unchanged, that may train, may
  leave this machine, and lists this target;
* limits: the job's [remote] section declares wall_hours, gpu_hours, cost and nodes, each within
  the target's caps, and the declared cost covers the declared GPU hours at the target's rate;
* fit: the estimated peak memory per process fits what a node offers each process, the
  expected time fits the declared wall hours, and world_size fits the nodes and their GPUs.

Checking writes nothing; ``record_refusal`` and ``record_approval`` put the verdict in the ledger.
No torch at import: the estimate (tokenizer, memory model) is imported when it is needed.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import JobConfig
from ..errors import GateRefused, LodgerError
from .targets import Target, TargetError, get_target
from ..train.precision import mode

GiB = 2**30
LIMITS = ("wall_hours", "gpu_hours", "cost", "nodes")


@dataclass(frozen=True)
class LeavingFile:
    """One file that would be copied to the target."""

    role: str      # "data:train", "data:eval", "model", "job"
    path: Path
    size: int
    sha256: str


@dataclass
class Plan:
    """What an approved submission sends and may spend; the remote side runs exactly this."""

    job_path: Path
    job: JobConfig
    target_name: str
    target: Target
    files: list[LeavingFile] = field(default_factory=list)
    estimate: dict = field(default_factory=dict)
    cost: float = 0.0          # upper bound: declared gpu_hours x the target's cost per GPU hour
    datasets: list[dict] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def job_hash(self) -> str:
        from ..config import job_hash  # the same identity a local run of this job records

        return job_hash(self.job)

    def summary(self) -> dict[str, Any]:
        """The plan as JSON-ready data (shown by `submit --json`, recorded with the approval)."""
        return {
            "job_path": str(self.job_path), "job_hash": self.job_hash(), "target": self.target_name,
            "address": self.target.address, "target_kind": self.target.kind,
            "files": [{"role": f.role, "path": str(f.path), "size": f.size, "sha256": f.sha256} for f in self.files],
            "bytes": self.bytes,
            "limits": {k: getattr(self.job.remote, k) for k in LIMITS},
            "caps": caps(self.target),
            "cost_per_gpu_hour": self.target.cost_per_gpu_hour, "cost": self.cost,
            "world_size": self.job.training.world_size,
            "estimate": self.estimate, "datasets": self.datasets,
        }


def caps(target: Target) -> dict[str, Any]:
    """The target's caps under the names of the job's limits (None: no cap)."""
    return {"wall_hours": target.wall_hours, "gpu_hours": target.gpu_hours, "cost": target.budget,
            "nodes": target.nodes}


def _sha256(path: Path) -> str:
    from ..model import cached_hash  # remembered by (path, size, mtime): a model is hashed once

    return cached_hash(path)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def check(job_path: Path, target_name: str) -> Plan:
    """Check ``job_path`` against target ``target_name``; return the Plan or raise GateRefused."""
    from ..lifecycle.jobfile import load_job

    job_path = Path(job_path)
    reasons: list[str] = []
    target = job = None
    try:
        target = get_target(target_name, recorded=True)  # caps as the chain recorded them
    except TargetError as exc:
        reasons.append(str(exc))
    try:
        job = load_job(job_path)  # refuses changed datasets and data that may not train
    except LodgerError as exc:
        reasons.append(str(exc))
    if job is None or target is None:
        raise GateRefused(reasons, job_hash=None)
    plan = Plan(job_path.resolve(), job, target_name, target,
                cost=(job.remote.gpu_hours or 0.0) * target.cost_per_gpu_hour)
    reasons += _check_data(plan)
    reasons += _check_model(plan)
    plan.files.append(LeavingFile("job", plan.job_path, plan.job_path.stat().st_size, file_sha256(plan.job_path)))
    reasons += _check_limits(job, target)
    reasons += _check_shape(job, target)
    reasons += _check_fit(plan)
    if reasons:
        raise GateRefused(reasons, plan=plan, job_hash=plan.job_hash())
    return plan


def _check_data(plan: Plan) -> list[str]:
    reasons = []
    for use in plan.job.data_uses():
        plan.files.append(LeavingFile(f"data:{use.role}", use.file.path, use.file.size, use.file.sha256))
        d = use.dataset
        where = f"[data] {use.role} ({use.file.path})"
        if d is None:
            plan.datasets.append({"role": use.role, "name": None, "path": str(use.file.path),
                                  "sha256": use.file.sha256})
            reasons.append(f"{where} is not a registered dataset, and only registered data may leave this machine; "
                           f"fix: `lodger data add {use.file.path} --name NAME --license L --owner O`, then "
                           f"`lodger data grant NAME --leave --target {plan.target_name}`")
            continue
        plan.datasets.append({"role": use.role, "name": d.name, "license": d.license, "owner": d.owner,
                              "sha256": d.sha256, **d.permissions()})
        if not d.may_leave:
            reasons.append(f"{where}: dataset {d.name!r} (license {d.license}, owner {d.owner}) may not leave this "
                           f"machine; fix: if its owner allows it, `lodger data grant {d.name} --leave`")
        if plan.target_name not in d.targets:
            allowed = ", ".join(d.targets) or "none"
            reasons.append(f"{where}: dataset {d.name!r} is not allowed on target {plan.target_name!r} (allowed: "
                           f"{allowed}); fix: if its owner allows it, `lodger data grant {d.name} --target "
                           f"{plan.target_name}`")
    return reasons


def _check_model(plan: Plan) -> list[str]:
    """The model's source files leave too (the cluster must train the same bytes)."""
    from ..model import resolve_source

    try:
        source = resolve_source(plan.job.model.source)
    except LodgerError as exc:
        return [str(exc)]
    paths = [source.path] if source.path.is_file() else sorted(
        p for p in source.path.rglob("*") if p.is_file() and not p.name.startswith("."))
    plan.files += [LeavingFile("model", p, p.stat().st_size, _sha256(p)) for p in paths]
    return []


def _check_limits(job: JobConfig, target: Target) -> list[str]:
    remote, reasons = job.remote, []
    for key in LIMITS:
        if getattr(remote, key) is None:
            reasons.append(f"[remote] {key}: missing; remote jobs declare every limit (wall_hours, gpu_hours, "
                           f"cost, nodes); fix: add `{key} = ...` under [remote] in the job file")
    for key, cap in caps(target).items():
        value = getattr(remote, key)
        if value is not None and cap is not None and value > cap:
            reasons.append(f"[remote] {key} = {value!r}: over the target's cap of {cap!r}; fix: lower it, or raise "
                           f"the cap with `lodger target add ... --replace`")
    rate = target.cost_per_gpu_hour
    if remote.cost is not None and remote.gpu_hours is not None and remote.cost < remote.gpu_hours * rate - 1e-9:
        reasons.append(f"[remote] cost = {remote.cost!r}: does not cover gpu_hours = {remote.gpu_hours!r} at "
                       f"{rate!r} per GPU hour ({remote.gpu_hours * rate:g}); fix: raise cost or lower gpu_hours")
    return reasons


def _check_shape(job: JobConfig, target: Target) -> list[str]:
    """world_size processes spread evenly over the declared nodes, one GPU each where there are GPUs."""
    world, nodes = job.training.world_size, job.remote.nodes or 1
    reasons = []
    if world < nodes or world % nodes:
        reasons.append(f"[training] world_size = {world} does not spread evenly over [remote] nodes = {nodes}; "
                       "fix: make world_size a multiple of nodes")
    per_node = math.ceil(world / nodes)
    if target.gpus_per_node and per_node > target.gpus_per_node:
        reasons.append(f"[training] world_size = {world} on {nodes} node(s) is {per_node} processes per node, but "
                       f"each node has {target.gpus_per_node} GPU(s); fix: more nodes or a smaller world_size")
    if not target.gpus_per_node and job.training.device == "cuda":
        reasons.append("[training] device = \"cuda\", but the target has no GPUs (gpus_per_node = 0); fix: use "
                       "\"auto\" or \"cpu\", or another target")
    precision = mode(job.training.precision)
    if not target.gpus_per_node and precision.needs_gpu:
        reasons.append(f"[training] precision = \"{precision.name}\" needs GPUs, and the target has none; fix: use "
                       f"\"{precision.cpu_instead}\"")
    return reasons


def _check_fit(plan: Plan) -> list[str]:
    """Memory per process and the whole job's time, from the estimator, on the target's device."""
    import json

    from ..memory import estimate as memory
    from ..lifecycle.prepare import prepare

    job, target = plan.job, plan.target
    device = "cuda" if target.gpus_per_node and job.training.device != "cpu" else "cpu"
    try:
        prepared = prepare(job, device=device)
    except LodgerError as exc:
        return [str(exc)]
    model_config = json.loads((prepared.folder / "config.json").read_text())
    offsets = prepared.train_set.offsets
    seq = min(job.data.max_length, int((offsets[1:] - offsets[:-1]).max()))
    threads = job.training.threads
    # Only the target's declared speed says how long the job takes there: this machine's rate says
    # nothing about another machine's GPUs (or CPUs), so without it the time is unknown.
    rate = target.tflops * 1e12 if target.tflops else None
    runtime = None if device == "cuda" else memory.runtime_bytes(threads=threads, use_current=False)
    est = memory.estimate(job, model_config, seq_len=seq, device=device, runtime_bytes=runtime,
                          flops_per_second=rate, total_steps=prepared.total_steps,
                          examples=memory.reference_examples(prepared))
    world, nodes = job.training.world_size, job.remote.nodes or 1
    if target.memory_gb_per_node is None:
        per_process = None
    elif device == "cuda":
        per_process = target.memory_gb_per_node * GiB / target.gpus_per_node
    else:
        per_process = target.memory_gb_per_node * GiB / math.ceil(world / nodes)
    hours = est.job_seconds / 3600 if est.job_seconds is not None else None
    plan.estimate = {"device": device, "peak_bytes_per_process": est.total_bytes, "largest": est.largest,
                     "items": est.items, "available_bytes_per_process": per_process,
                     "step_seconds": est.step_seconds, "total_steps": prepared.total_steps,
                     "expected_hours": hours, "flops_per_second": rate,
                     "rate_from": f"target {plan.target_name}: {target.tflops:g} TFLOP/s per process" if target.tflops
                     else None,
                     "time_unknown_because": None if target.tflops else
                     f"target {plan.target_name} declares no speed; `lodger target add {plan.target_name} ... "
                     "--tflops N --replace` sets it (the sustained TFLOP/s of one training process there)"}
    reasons = []
    if per_process is not None and est.total_bytes > per_process:
        reasons.append(f"estimate: {est.total_bytes / GiB:.2f} GiB peak per process ({device}; largest item "
                       f"{est.largest}) does not fit the {per_process / GiB:.2f} GiB each process gets there "
                       f"(memory_gb_per_node {target.memory_gb_per_node:g} over "
                       f"{target.gpus_per_node if device == 'cuda' else math.ceil(world / nodes)} process(es)); "
                       "fix: lower batch_size or max_length, use gradient_checkpointing or LoRA "
                       "(`lodger estimate JOB` shows the breakdown)")
    wall = job.remote.wall_hours
    if hours is not None and wall is not None and hours > wall:
        reasons.append(f"estimate: about {hours:.3g} hours expected ({prepared.total_steps} steps at "
                       f"{est.step_seconds:.3g} s, {plan.estimate['rate_from']}), more than [remote] wall_hours = "
                       f"{wall!r}; fix: raise wall_hours (within the cap), shorten the job, or set the target's "
                       "--tflops if it is faster")
    return reasons


def _job_file_sha(job_path: Path) -> str | None:
    try:
        return file_sha256(job_path)
    except OSError:
        return None


def record_refusal(job_path: Path, target_name: str, refused: GateRefused) -> None:
    """A `submit_refused` ledger event with the target, the job's identity and every reason."""
    from ..ledger import Ledger

    with Ledger() as ledger:
        ledger.event(None, "submit_refused", target=target_name, job_path=str(Path(job_path).resolve()),
                     job_hash=refused.job_hash, job_file_sha256=_job_file_sha(Path(job_path)),
                     reasons=refused.reasons)


def record_approval(plan: Plan, how: str) -> None:
    """A `submit_approved` ledger event with the plan's summary, how it was approved, and the
    chain's head just before it (what a later `lodger audit --against` can be checked with)."""
    from ..ledger import Ledger

    with Ledger() as ledger, ledger.transaction():
        ledger.event(None, "submit_approved", approved_by=how, chain_head=ledger.head(), **plan.summary())
