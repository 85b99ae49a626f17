"""What the loop asks of the collaborators it is given, as Protocols: the members ``train`` and
``evaluate`` use (loop.py), and nothing else, handed over as one typed value (``Collaborators``).
Any object with these members will do (the synchronisers in sync.py, the Checkpointer, the
Recorder, lodger's Control, a test's fake: tests/unit/test_train_fakes.py); mypy checks the loop
against them. What the recorder and the checkpointer may ask of the ledger is narrower still:
``record.RunRecords`` (an event, metric rows, a transaction, the run's status), never the whole
Ledger. The state the loop steps is ``state.TrainState``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from ..data.packing import PackedBatch, StepPlan
    from .record import StepRecord


class Synchronising(Protocol):
    """How the processes of one run agree at a step (sync.py: one process, or data-parallel ranks)."""

    rank: int
    world_size: int
    saves_alone: bool

    def start(self, model: Any) -> bool: ...

    def micro_step(self) -> None: ...

    def finish_step(self, params: list, loss_sum: "torch.Tensor", last_save: float) -> "torch.Tensor": ...

    def releasing(self) -> bool: ...

    def stopping(self) -> bool: ...

    def save_due(self, last_save: float) -> bool: ...

    def sum_across(self, values: list[float]) -> list[float]: ...


class Checkpointing(Protocol):
    """Commits the holders' state as a checkpoint, and rolls back to the last good one."""

    def save(self, skip_if_exists: bool = False) -> "Path": ...

    def rollback(self, guard: Any) -> None: ...


class Reporting(Protocol):
    """The step line's and the log's side of an eval (reporting/report.py)."""

    def eval_started(self, step: int, examples: int, batches: int) -> None: ...

    def eval_progress(self, step: int, done: int, batches: int) -> None: ...


class Recording(Protocol):
    """Metric lines, eval results and events of the run (record.py)."""

    reporter: Reporting
    eval_seconds: float

    def step(self, s: StepRecord) -> None: ...

    def eval(self, step: int, result: tuple[float, dict[str, Any]] | None) -> None: ...

    def has_eval_at(self, step: int) -> bool: ...

    def spike(self, step: int, loss: float, zscore: float) -> None: ...


class Controlling(Protocol):
    """The run's answer to the owner (owner/control.py): whether a release may drop the current step, and
    how long the owner has held it."""

    in_step: bool
    held_seconds: float


class Planning(Protocol):
    """Each step's micro-batches from its sampler position (data/packing.py)."""

    def plan(self, position: int) -> "StepPlan": ...

    def next_start(self, position: int, skip: Iterable[int]) -> int: ...

    def collate(self, dataset: Any, pack: Sequence[Sequence[int]], pad_id: int) -> "PackedBatch": ...


class Objective(Protocol):
    """What a step's loss is (objective.py)."""

    name: str

    def prepare(self, model: Any, batches: list, step: int | None, position: int | None) -> list: ...

    def target_tokens(self, dataset: Any, indices: list[int]) -> int: ...

    def weights(self, dataset: Any, indices: list[int]) -> tuple[float, ...]: ...

    def terms(self, model: Any, batch: Any, device: str) -> tuple["torch.Tensor", "torch.Tensor | None"]: ...

    def combine(self, terms: Any, weights: tuple[float, ...]) -> Any: ...

    def metrics(self, sums: "torch.Tensor", weights: tuple[float, ...]) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Collaborators:
    """What ``train`` is given besides the state it steps: the way of training, the recorder, the
    checkpointer and the run's control, each as the narrow protocol above."""

    checkpointer: Checkpointing
    recorder: Recording
    control: Controlling
    sync: Synchronising
