"""Numeric guards: skip non-finite steps, roll back after too many in a row, record loss spikes.

The guard's state is saved in every checkpoint and restored on resume, so its decisions are part
of the exact, reproducible run. A rollback keeps the guard's own state (it must remember what went
wrong) while everything else returns to the checkpoint.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from typing import TYPE_CHECKING

from ..errors import LodgerError

if TYPE_CHECKING:
    from ..config import GuardConfig


class TrainingDiverged(LodgerError):
    """Non-finite numbers kept coming back after the allowed rollbacks; the message is the report."""


@dataclass
class GuardState:
    bad_in_row: int = 0
    rollbacks: int = 0
    lr_scale: float = 1.0
    skip_positions: list[int] = field(default_factory=list)  # step batches never to train on again
    bad_positions: list[int] = field(default_factory=list)   # batches of the current run of bad steps
    bad_steps: list[int] = field(default_factory=list)       # every skipped step, for the report
    recent: list[float] = field(default_factory=list)        # recent finite losses (spike detector)


class Guard:
    """Judges each finished step by its loss (skip, roll back, spike) and owns ``GuardState``, which
    a checkpoint carries so that a resumed run skips the same batches and keeps its lr scale."""

    def __init__(self, cfg: GuardConfig, state: dict | None = None):
        self.cfg = cfg
        self.state = GuardState(**state) if state else GuardState()

    def as_dict(self) -> dict:
        return asdict(self.state)

    def next_position(self, position: int, step_size: int) -> int:
        """Jump over batches that caused a rollback."""
        while position in self.state.skip_positions:
            position += step_size
        return position

    def after_step(self, step: int, position: int, loss: float, finite: bool) -> tuple[str, float | None]:
        """Classify a finished step: ("ok"|"skipped"|"rollback"|"spike", robust z-score or None)."""
        st = self.state
        if not finite:
            st.bad_in_row += 1
            st.bad_positions.append(position)
            st.bad_steps.append(step)
            return ("rollback" if st.bad_in_row >= self.cfg.max_bad_steps else "skipped"), None
        st.bad_in_row, st.bad_positions = 0, []
        z = self._zscore(loss)
        st.recent = (st.recent + [loss])[-self.cfg.spike_window:]
        return ("spike" if z is not None and z > self.cfg.spike_zscore else "ok"), z

    def _zscore(self, loss: float) -> float | None:
        window = self.state.recent
        if len(window) < 10:
            return None
        median = statistics.median(window)
        mad = statistics.median(abs(x - median) for x in window)
        return None if mad == 0 else (loss - median) / (1.4826 * mad)

    def start_rollback(self) -> dict:
        """Record a rollback (or refuse one too many); return the guard state to carry across it."""
        st = self.state
        if st.rollbacks >= self.cfg.max_rollbacks:
            raise TrainingDiverged(
                f"stopped: non-finite loss or gradient norm at steps {st.bad_steps} after {st.rollbacks} "
                f"rollback(s) (lr now x{st.lr_scale:g}); check the data lines logged with those steps, lower "
                "[training] learning_rate, or raise [guard] max_rollbacks")
        st.rollbacks += 1
        st.lr_scale *= self.cfg.lr_factor
        st.skip_positions = sorted(set(st.skip_positions) | set(st.bad_positions))
        st.bad_positions, st.bad_in_row = [], 0
        return self.as_dict()
