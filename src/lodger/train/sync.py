"""How the processes training one run agree at a step: one implementation per way of training.

The loop calls the same methods whichever it is given, so it has no world-size branches:

- ``start(model)``: before the first step; True when the run must stop before training.
- ``micro_step()``: before each micro-batch (where one process answers hold and release).
- ``finish_step(params, loss_sum, last_save)``: after the backward passes; returns the step's loss.
- ``releasing()``, ``stopping()``, ``save_due(last_save)``: what the step ends with.
- ``agree_checkpoint(store, check, on_damaged)``, ``gather_rng(make)``, ``barrier()``: for the
  checkpointer; ``writes`` says whether this process writes the run's files and ledger.
- ``saves_alone``: whether this process may save a checkpoint no other process is saving.
- ``rank``, ``world_size``: which share of a step's plan this process trains (``plan.share``).

A federated synchroniser (processes on different machines that train apart and meet every few
steps) is a third class with exactly these members, chosen in ``train.state.make_sync``:

- ``rank``/``world_size``: 0/1 when each site trains its own data (its whole plan), or the site's
  index and count when the sites split one plan;
- ``start`` joins the federation (True: stop before training); ``micro_step`` answers local hold
  and release as ``LocalSync`` does;
- ``finish_step`` returns the loss and, when a round is due, sends this site's weights (or their
  change since the round began) and loads the aggregate before the optimizer step carries on (so
  it must be given, or hold, the trainable parameters: it receives ``params``);
- ``releasing``/``stopping``/``save_due`` are answered from the coordinator's flags, as
  ``DataParallelSync`` does from rank 0's, so every site saves at the same step;
- ``agree_checkpoint`` names the checkpoint of the last completed round (every site restores the
  same one), ``gather_rng`` returns None (each site keeps its own generators), ``barrier`` waits
  for the round, ``writes``/``saves_alone`` are true on the process that records the run.
The loop needs nothing else: it never asks which kind it was given.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..ckpt_interval import interval_for
from ..owner.control import ReleaseRequested

if TYPE_CHECKING:
    import torch

    from ..checkpoint import Checkpoint, CheckpointStore
    from ..owner.control import Control
    from .limits import LimitWatch

Check = Callable[["Checkpoint"], None]           # raises CheckpointError when a checkpoint cannot be restored
OnDamaged = Callable[[Path, str, Path], None]  # (the damaged folder, why, where it was moved aside)


def _newest_good(store: CheckpointStore, check: Check, on_damaged: OnDamaged | None) -> Checkpoint | None:
    return store.latest_good(on_damaged=on_damaged, check=check)


class LocalSync:
    """One process: hold and release are answered at every micro-step and every layer."""

    rank, world_size, writes, saves_alone = 0, 1, True, True

    def __init__(self, control: Control, limits: LimitWatch, every_seconds: float | str | None):
        self.control, self.limits = control, limits
        # interval.seconds(last_save): seconds between time-based saves, None for none. "auto" needs
        # the run's ledger: the Session sets the live one (ckpt_interval.AutoInterval) on rank 0.
        self.interval = interval_for(every_seconds, None, "")

    def start(self, model: torch.nn.Module) -> bool:
        from .step import install_yield_points

        install_yield_points(model, self.control)
        return bool(self.control.stop)  # Ctrl-C or SIGTERM while starting: nothing trained, nothing to commit

    def micro_step(self) -> None:
        self.limits.check()
        self.control.checkpoint_boundary()  # microseconds; where hold and release are answered

    def finish_step(self, params: list[torch.nn.Parameter], loss_sum: torch.Tensor, last_save: float) -> torch.Tensor:
        return loss_sum

    def releasing(self) -> bool:
        return False  # a release raised ReleaseRequested inside the step

    def stopping(self) -> bool:
        return bool(self.control.stop)

    def save_due(self, last_save: float) -> bool:
        every = self.interval.seconds(last_save)
        return every is not None and time.monotonic() - last_save >= every

    def agree_checkpoint(self, store: CheckpointStore, check: Check,
                         on_damaged: OnDamaged | None = None) -> Checkpoint | None:
        return _newest_good(store, check, on_damaged)

    def gather_rng(self, make: Callable[[], dict]) -> list[dict] | None:
        return None

    def sum_across(self, values: list[float]) -> list[float]:
        return list(values)

    def barrier(self) -> None:
        pass


class DataParallelSync:
    """Several ranks (distributed.py): one all-reduce per step sums the gradients and the loss, and
    carries rank 0's answer to its control requests (release, stop, time-based checkpoint), so every
    rank acts on the same flags at the same step. A hold on rank 0 holds every rank there."""

    saves_alone = False  # a lone rank 0 save would wait for the others at the barrier

    def __init__(self, control: Control, limits: LimitWatch, every_seconds: float | str | None, rank: int,
                 world_size: int):
        self.control, self.limits, self.interval = control, limits, interval_for(every_seconds, None, "")
        self.rank, self.world_size, self.writes = rank, world_size, rank == 0
        self.flags = (False, False, False)

    def start(self, model: torch.nn.Module) -> bool:
        return False  # requests are answered together, once per step (finish_step)

    def micro_step(self) -> None:
        pass

    def finish_step(self, params: list[torch.nn.Parameter], loss_sum: torch.Tensor, last_save: float) -> torch.Tensor:
        # Ranks act only on what rank 0 said here: a signal arriving later waits for the next step,
        # or one rank would checkpoint alone.
        from ..distributed import N_FLAGS, RELEASE, SAVE_DUE, STOP, reduce_step

        flags = [0.0] * N_FLAGS
        if self.rank == 0:
            self.limits.check()
            try:
                self.control.checkpoint_boundary()
            except ReleaseRequested:  # with several ranks a release finishes the step first
                flags[RELEASE] = 1.0
            flags[STOP] = float(self.control.stop is not None)
            every = self.interval.seconds(last_save)
            flags[SAVE_DUE] = float(every is not None and time.monotonic() - last_save >= every)
        loss_sum, summed = reduce_step(params, loss_sum, flags)
        self.flags = (summed[RELEASE] > 0, summed[STOP] > 0, summed[SAVE_DUE] > 0)
        return loss_sum

    def releasing(self) -> bool:
        return self.flags[0]

    def stopping(self) -> bool:
        return self.flags[1]

    def save_due(self, last_save: float) -> bool:
        return self.flags[2]  # rank 0's clock decides, or the ranks would disagree about saving

    def agree_checkpoint(self, store: CheckpointStore, check: Check,
                         on_damaged: OnDamaged | None = None) -> Checkpoint | None:
        """The newest good checkpoint, as rank 0 finds it (only rank 0 moves damaged ones aside)."""
        from ..distributed import broadcast_int

        if self.rank == 0:
            ckpt = _newest_good(store, check, on_damaged)
            broadcast_int(-1 if ckpt is None else ckpt.step)
            return ckpt
        step = broadcast_int(-1)
        return None if step < 0 else store.load_step(step)

    def gather_rng(self, make: Callable[[], dict]) -> list[dict] | None:
        # Weights and optimizer state are identical on all ranks (identical summed gradients), so
        # rank 0's are saved once; every rank's RNG goes to rank 0 as JSON.
        from ..distributed import gather_rng

        return gather_rng(make())

    def sum_across(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks (GRPO's step totals: completions and their tokens)."""
        from ..distributed import sum_across

        return sum_across(values)

    def barrier(self) -> None:
        from ..distributed import barrier

        barrier()


class FederatedSync:
    """The slot a federated mode takes (not implemented): processes on different machines that
    train apart and meet every few steps. It would implement the methods above with
    ``finish_step`` averaging weights (not gradients) when a round is due, ``agree_checkpoint``
    naming the round's checkpoint, and ``writes`` true on the coordinator only. Choose it in
    ``train.state.make_sync`` from a config value."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise NotImplementedError("federated training is not implemented; see train/sync.py")
