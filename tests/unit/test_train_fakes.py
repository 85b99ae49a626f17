"""``train()`` with fakes of the collaborators it is given (train/collaborators.py): a real tiny
model, optimizer, guard and step plan, and a synchroniser, recorder, checkpointer and control that
only write down what the loop asked of them. The end-to-end tests run the same loop for real."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from lodger.config.training import GuardConfig, TrainingConfig
from lodger.data.chats import TokenizedSet, make_sampler
from lodger.data.packing import example_lengths, make_planner
from lodger.train.collaborators import Collaborators
from lodger.train.guard import Guard
from lodger.train.holders import Progress
from lodger.train.loop import train
from lodger.train.objective import SFT
from lodger.train.optim import build_optimizer
from lodger.train.precision import Precision
from lodger.train.record import StepRecord
from lodger.train.state import TrainState

VOCAB, EXAMPLES, LENGTH = 32, 8, 6


class FakeReporter:
    def __init__(self) -> None:
        self.evals: list[int] = []

    def eval_started(self, step: int, examples: int, batches: int) -> None:
        self.evals.append(step)

    def eval_progress(self, step: int, done: int, batches: int) -> None:
        pass


@dataclass
class FakeRecorder:
    reporter: FakeReporter = field(default_factory=FakeReporter)
    eval_seconds: float = 0.0
    steps: list[StepRecord] = field(default_factory=list)
    evals: dict[int, float] = field(default_factory=dict)

    def step(self, s: StepRecord) -> None:
        self.steps.append(s)

    def eval(self, step: int, result: tuple[float, dict[str, Any]] | None) -> None:
        if result is not None:
            self.evals[step] = result[0]

    def has_eval_at(self, step: int) -> bool:
        return step in self.evals

    def spike(self, step: int, loss: float, zscore: float) -> None:
        pass


@dataclass
class FakeCheckpointer:
    progress: Progress
    saved: list[int] = field(default_factory=list)

    def save(self, skip_if_exists: bool = False) -> Path:
        if not (skip_if_exists and self.progress.step in self.saved):
            self.saved.append(self.progress.step)
        return Path(f"step-{self.progress.step:08d}")

    def rollback(self, guard: Any) -> None:
        raise AssertionError("no step of this model goes bad")


@dataclass
class FakeControl:
    in_step: bool = False
    held_seconds: float = 0.0


@dataclass
class FakeSync:
    """One process; asks the loop to stop or release after ``after`` steps, as the owner would."""

    progress: Progress
    stop_after: int | None = None
    release_after: int | None = None
    rank: int = 0
    world_size: int = 1
    saves_alone: bool = True
    micro_steps: int = 0

    def start(self, model: Any) -> bool:
        return False

    def micro_step(self) -> None:
        self.micro_steps += 1

    def finish_step(self, params: list[Any], loss_sum: torch.Tensor, last_save: float) -> torch.Tensor:
        return loss_sum

    def releasing(self) -> bool:
        return self.release_after is not None and self.progress.step >= self.release_after

    def stopping(self) -> bool:
        return self.stop_after is not None and self.progress.step >= self.stop_after

    def save_due(self, last_save: float) -> bool:
        return False

    def sum_across(self, values: list[float]) -> list[float]:
        return values


def _state(steps: int, every_steps: int | None, learning_rate: float = 2e-4) -> TrainState:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    training = TrainingConfig(steps=steps, batch_size=2, eval_every=2, threads=1, packing=False,
                              learning_rate=learning_rate)
    ids = torch.randint(1, VOCAB, (EXAMPLES * LENGTH,), generator=torch.Generator().manual_seed(1))
    data = TokenizedSet(ids, torch.ones_like(ids), torch.arange(0, EXAMPLES * LENGTH + 1, LENGTH),
                        torch.arange(EXAMPLES))
    train_indices, eval_indices = list(range(6)), [6, 7]
    lengths = example_lengths(data)
    planner = make_planner(training, LENGTH, make_sampler(training, train_indices, lengths), lengths, False)
    params = [q for q in model.parameters() if q.requires_grad]
    return TrainState(training=training, every_steps=every_steps, model=model,
                      optimizer=build_optimizer(params, training), precision=Precision("fp32", "cpu"),
                      guard=Guard(GuardConfig()), planner=planner, progress=Progress(), train_set=data, eval_set=data,
                      eval_indices=eval_indices, pad_id=0, device="cpu", total_steps=steps, objective=SFT())


def _parts(st: TrainState, **sync: int) -> tuple[Collaborators, FakeRecorder, FakeCheckpointer, FakeSync]:
    recorder, checkpointer = FakeRecorder(), FakeCheckpointer(st.progress)
    fake_sync = FakeSync(st.progress, **sync)
    parts = Collaborators(checkpointer=checkpointer, recorder=recorder, control=FakeControl(), sync=fake_sync)
    return parts, recorder, checkpointer, fake_sync


def test_train_steps_to_the_end_records_every_step_evaluates_on_schedule_and_checkpoints_when_due() -> None:
    st = _state(steps=4, every_steps=3)
    parts, recorder, checkpointer, sync = _parts(st)
    assert train(st, parts) == "finished"
    assert [s.step for s in recorder.steps] == [1, 2, 3, 4]
    assert all(s.tokens > 0 and not s.skipped for s in recorder.steps)
    assert sorted(recorder.evals) == [0, 2, 4]  # the start, every eval_every steps, the end
    assert checkpointer.saved == [3, 4]  # every_steps, and the last step
    assert sync.micro_steps == 4  # one micro-batch a step (batch_size 2, grad_accum 1)
    assert st.progress.step == 4 and st.progress.tokens == sum(s.tokens for s in recorder.steps)


def test_a_stop_asked_mid_run_commits_the_finished_step_and_returns_interrupted() -> None:
    st = _state(steps=6, every_steps=None)
    parts, recorder, checkpointer, _ = _parts(st, stop_after=2)
    assert train(st, parts) == "interrupted"
    assert checkpointer.saved == [2] and st.progress.step == 2
    assert [s.step for s in recorder.steps] == [1, 2]


def test_a_release_returns_paused_with_its_checkpoint_committed() -> None:
    st = _state(steps=6, every_steps=None)
    parts, recorder, checkpointer, _ = _parts(st, release_after=3)
    assert train(st, parts) == "paused"
    assert checkpointer.saved == [3] and [s.step for s in recorder.steps] == [1, 2, 3]


def test_the_loss_falls_when_the_same_fakes_train_longer() -> None:
    st = _state(steps=6, every_steps=None, learning_rate=3e-2)
    parts, recorder, _, _ = _parts(st)
    train(st, parts)
    losses = [s.loss for s in recorder.steps]
    assert losses[-1] < losses[0], losses
    assert recorder.evals[6] < recorder.evals[0]


@pytest.mark.parametrize("member", ["step", "eval", "has_eval_at", "spike"])
def test_the_fake_recorder_has_what_the_loop_asks_of_a_recorder(member: str) -> None:
    from lodger.train.collaborators import Recording

    assert member in Recording.__dict__ and callable(getattr(FakeRecorder(), member))
