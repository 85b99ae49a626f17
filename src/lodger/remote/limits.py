"""The [remote] limits, enforced by the remote job itself (no torch, no ray).

The cluster is not ours to watch, so the training process checks its own wall time, GPU hours
and cost at every micro-step and, at a limit, commits a checkpoint and stops (the same path as
[limits] max_compute_hours: a "limit" release request, exit 3). Wall time counts every segment
of the run, so a resumed job does not get a fresh allowance.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

REMOTE_ENV = "LODGER_REMOTE"                  # "1" in a job started on a remote target
COST_ENV = "LODGER_COST_PER_GPU_HOUR"         # the target's price, passed along with the job


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

    @classmethod
    def for_this_process(cls, remote, device: str, world_size: int) -> "RemoteLimits | None":
        """The limits to enforce here, or None when not running remotely or nothing is declared."""
        if not running_remotely() or (remote.wall_hours is None and remote.gpu_hours is None
                                      and remote.cost is None):
            return None
        price = float(os.environ.get(COST_ENV) or 0.0)
        return cls(remote.wall_hours, remote.gpu_hours, remote.cost,
                   world_size if device == "cuda" else 0, price)

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
