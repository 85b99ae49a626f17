"""What a training process may use, and the watch that stops it at a limit (no torch at import).

[limits] (priority, memory ceiling, CPU hours) apply to every run; the [remote] limits are
enforced by the remote job itself: the cluster is not ours to watch, so the training process
checks its own wall time, GPU hours and cost at every micro-step and, at a limit, commits a
checkpoint and stops (the same path as [limits] max_compute_hours: a "limit" release request,
exit 3). Wall time counts every segment of the run, so a resumed job gets no fresh allowance:
those recorded in the ledger and, through heartbeats in storage, those killed without a word.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING, Any

from ..owner.control import Control, write_request

if TYPE_CHECKING:
    from ..config import JobConfig, LimitsConfig, RemoteConfig
    from ..ledger.provenance import ComputeMeter

REMOTE_ENV = "LODGER_REMOTE"                  # "1" in a job started on a remote target
COST_ENV = "LODGER_COST_PER_GPU_HOUR"         # the target's price, passed along with the job
PRIOR_WALL_ENV = "LODGER_PRIOR_WALL_SECONDS"  # earlier submissions' wall time, from their heartbeats


def running_remotely() -> bool:
    return os.environ.get(REMOTE_ENV) == "1"


@dataclass(frozen=True)
class RemoteLimits:
    """The job's declared remote limits and what this process uses to measure them."""

    wall_hours: float | None
    gpu_hours: float | None
    cost: float | None
    gpus: int                 # GPUs in use by the job (0 on the CPU)
    cost_per_gpu_hour: float
    prior_wall_seconds: float = 0.0  # every earlier submission, killed ones included (remote/heartbeat.py)

    @classmethod
    def for_this_process(cls, remote: RemoteConfig, device: str, world_size: int) -> "RemoteLimits | None":
        """The limits to enforce here, or None when not running remotely or nothing is declared."""
        if not running_remotely() or (remote.wall_hours is None and remote.gpu_hours is None
                                      and remote.cost is None):
            return None
        price = float(os.environ.get(COST_ENV) or 0.0)
        try:
            prior = max(0.0, float(os.environ.get(PRIOR_WALL_ENV) or 0.0))
        except ValueError:
            prior = 0.0
        return cls(remote.wall_hours, remote.gpu_hours, remote.cost,
                   world_size if device == "cuda" else 0, price, prior)

    def measure(self, wall_seconds: float) -> dict:
        gpu_hours = wall_seconds / 3600 * self.gpus
        return {"wall_hours": wall_seconds / 3600, "gpu_hours": gpu_hours,
                "cost": gpu_hours * self.cost_per_gpu_hour}

    def reached(self, wall_seconds: float) -> str | None:
        """Why the job must stop now (wall time over all segments so far), or None."""
        used = self.measure(wall_seconds)
        if self.wall_hours is not None and used["wall_hours"] >= self.wall_hours:
            return (f"remote wall-time limit of {self.wall_hours:g} h reached ({used['wall_hours']:.4f} h used over "
                    "all segments); raise [remote] wall_hours and resubmit to continue")
        if self.gpu_hours is not None and self.gpus and used["gpu_hours"] >= self.gpu_hours:
            return (f"remote GPU-hour limit of {self.gpu_hours:g} reached ({used['gpu_hours']:.4f} GPU h on "
                    f"{self.gpus} GPU(s)); raise [remote] gpu_hours to continue")
        if self.cost is not None and self.gpus and used["cost"] >= self.cost:
            return (f"remote cost limit of {self.cost:g} reached ({used['cost']:.4f} at "
                    f"{self.cost_per_gpu_hour:g} per GPU hour); raise [remote] cost to continue")
        return None


def apply_limits(limits: LimitsConfig) -> dict:
    """Lower this process's CPU and I/O priority and cap GPU memory; return what was applied."""
    applied: dict = {}
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        if limits.nice > current:
            os.setpriority(os.PRIO_PROCESS, 0, limits.nice)
        applied["nice"] = os.getpriority(os.PRIO_PROCESS, 0)
    except OSError as exc:
        applied["nice_error"] = str(exc)
    if limits.ionice_idle:
        try:
            import psutil

            psutil.Process().ionice(psutil.IOPRIO_CLASS_IDLE)
            applied["ionice"] = "idle"
        except (ImportError, OSError, AttributeError, ValueError) as exc:
            applied["ionice_error"] = str(exc)
    if limits.gpu_memory_fraction:
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(limits.gpu_memory_fraction)
            applied["gpu_memory_fraction"] = limits.gpu_memory_fraction
    if limits.memory_gb:
        applied["memory_gb"] = limits.memory_gb
    if limits.max_compute_hours:
        applied["max_compute_hours"] = limits.max_compute_hours
    return applied


class LimitWatch:
    """Turns a reached memory ceiling, compute limit or remote limit into a "limit" release request.

    ``prior_cpu_seconds``/``prior_wall_seconds`` are earlier segments' (set by the run at start),
    so a resumed run gets no fresh allowance."""

    def __init__(self, job: JobConfig, device: str, folder: Path, control: Control, meter: ComputeMeter):
        limits = job.limits
        self.folder, self.control, self.meter = folder, control, meter
        self.memory_ceiling = int(limits.memory_gb * 2**30) if limits.memory_gb else None
        self.compute_limit = limits.max_compute_hours * 3600 if limits.max_compute_hours else None
        self.prior_cpu_seconds = 0.0
        self.remote = RemoteLimits.for_this_process(job.remote, device, job.training.world_size)
        self.prior_wall_seconds = 0.0

    def check(self) -> None:
        """Checked per micro-step (one process) or at the step's collective (rank 0)."""
        if self.memory_ceiling:
            import resource

            from ..reporting.report import rss_bytes

            peak = max(rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
            if peak > self.memory_ceiling:
                self._reached(f"memory ceiling {self.memory_ceiling / 2**30:.2f} GiB reached (peak resident "
                              f"{peak / 2**30:.2f} GiB); raise [limits] memory_gb, or lower batch_size / "
                              f"max_length", rss_bytes=peak)
        if self.compute_limit and self.prior_cpu_seconds + time.process_time() - self.meter.cpu0 > self.compute_limit:
            self._reached(f"compute limit of {self.compute_limit / 3600:g} CPU hours reached; raise "
                          "[limits] max_compute_hours to continue")
        if self.remote:
            # The ledger knows segments that ended cleanly; heartbeats also those killed without a word.
            wall = max(self.prior_wall_seconds, self.remote.prior_wall_seconds) + time.time() - self.meter.wall0
            reason = self.remote.reached(wall)
            if reason:
                self._reached(reason, **self.remote.measure(wall))

    def _reached(self, reason: str, **measured: Any) -> None:
        if self.control.release is None:
            write_request(self.folder, "limit", "release", reason, **measured)
            self.control.wake()
