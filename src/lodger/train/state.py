"""The live state of one process training one run: what the loop steps (``TrainState``: model,
optimizer, precision, guard, data and its step plans, counters), and the builders of its parts
that need only the job (the way of training, the checkpoint store, the limits, the trackers, the
rewards). ``lifecycle.session.Session`` puts them together with the model and the recorder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint import CheckpointStore
from ..ckpt_interval import interval_for
from ..config import JobConfig
from ..data.chats import TokenizedSet
from ..distributed import Ranks
from .determinism import configure_determinism
from .holders import Progress
from .limits import LimitWatch, apply_limits
from .sync import DataParallelSync, LocalSync

if TYPE_CHECKING:
    from ..config.model import MethodConfig
    from ..owner.control import Control
    from ..ledger import Ledger
    from ..reporting.feed import TrackerFeed
    from ..rewards import Rewards
    from .collaborators import Objective, Planning

__all__ = ["Progress", "TrainState"]


@dataclass(kw_only=True)
class TrainState:
    """What the loop steps, and nothing that records, saves or synchronises (those are given to
    ``train`` apart). Keyword-only: its fields are many and alike. ``planner`` turns a sampler position into the
    step's micro-batches
    (data/packing.py); ``progress``, the guard, the optimizer, the weights and the scaler are what a
    checkpoint holds (holders.py)."""

    training: Any            # the job's [training] section
    every_steps: int | None  # [checkpoints] every_steps
    model: Any
    optimizer: Any
    precision: Any
    guard: Any
    planner: "Planning"
    progress: Progress
    train_set: TokenizedSet
    eval_set: TokenizedSet | None
    eval_indices: list[int]
    pad_id: int
    device: str
    total_steps: int
    poisoned: Any = None     # test-only fault injection (faults.py)
    objective: "Objective"   # what a step's loss is (objective.py)


def make_sync(control: Control, limits: LimitWatch, job: JobConfig, ranks: Ranks) -> LocalSync | DataParallelSync:
    """The way of training: one process, or data parallel (a federated synchroniser, see sync.py,
    would be chosen here from its config)."""
    every = job.checkpoints.every_seconds
    if ranks.world_size == 1:
        return LocalSync(control, limits, every)
    return DataParallelSync(control, limits, every, ranks.rank, ranks.world_size)



def settle_process(job: JobConfig, device: str) -> dict[str, Any]:
    """This process as the job wants it before anything is built: its limits (returned as
    applied), torch's threads, the determinism settings, every generator seeded."""
    import torch

    from ..rng import seed_everything

    applied = apply_limits(job.limits)
    torch.set_num_threads(job.training.threads)
    configure_determinism(device)
    seed_everything(job.training.seed)
    return applied



def base_facts(method: MethodConfig, model: Any) -> dict[str, Any] | None:
    """[method] base_bits: the quantised base as provenance and the checkpoint record it (quant.facts)."""
    bits = getattr(method, "base_bits", None)
    if bits is None:
        return None
    from ..quant import facts

    return facts(bits, model)



def build_sync(control: Control, limits: LimitWatch, job: JobConfig, ranks: Ranks, ledger: Ledger | None,
               run_id: str) -> LocalSync | DataParallelSync:
    """The way of training (``make_sync``) with its checkpoint interval: "auto" reads and records in
    the run's ledger, which only rank 0 has (ckpt_interval.py)."""
    sync = make_sync(control, limits, job, ranks)
    sync.interval = interval_for(job.checkpoints.every_seconds, ledger if ranks.rank == 0 else None, run_id)
    return sync


def build_store(folder: Path, job: JobConfig, ranks: Ranks, sync: LocalSync | DataParallelSync) -> CheckpointStore:
    """The run's checkpoint store: rank 0 creates the folder first, the others after a barrier."""
    checkpoints, keep = folder / "checkpoints", job.checkpoints.keep_last
    store = CheckpointStore(checkpoints, keep, ranks.world_size) if ranks.rank == 0 else None
    sync.barrier()  # rank 0 has created the checkpoints folder; the others may not race it
    return store or CheckpointStore(checkpoints, keep, ranks.world_size)



def build_feed(job: JobConfig, run_id: str, *, writes: bool) -> TrackerFeed | None:
    """[report] to: the trackers told of each checkpoint's commit (reporting/feed.py), on the process
    that records the run; None when there are none."""
    if not job.report.to or not writes:
        return None
    from ..reporting.feed import TrackerFeed

    return TrackerFeed(run_id, job.report)


def build_rewards(job: JobConfig, control: Control) -> Rewards | None:
    """GRPO's reward functions (rewards/), waiting on them answering the owner's hold or release."""
    if job.method.objective != "grpo":
        return None
    from ..rewards import Rewards

    return Rewards(job.rewards, job.grpo, poll=control.yield_point)


