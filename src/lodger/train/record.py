"""What a training process records: metric lines (metrics.jsonl, then the ledger with each
checkpoint), step and eval lines on the reporter, and the run's events. Rank 0 records; the other
ranks' recorders only keep the control's step current."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .. import durable

if TYPE_CHECKING:
    from ..owner.control import Control


class RunRecords(Protocol):
    """What a training process may ask of the ledger (ledger/): an event, metric rows (added with
    each checkpoint, cut back on resume), a transaction around a checkpoint's records, a status."""

    def event(self, run_id: str | None, kind: str, **data: Any) -> int: ...

    def add_metrics(self, run_id: str, segment: int, rows: Iterable[dict[str, Any]]) -> None: ...

    def truncate_metrics(self, run_id: str, after_step: int, eval_kept: bool = True) -> int: ...

    def transaction(self) -> AbstractContextManager[Any]: ...

    def set_status(self, run_id: str, status: str, event: str | None = None, **data: Any) -> None: ...


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as it happened: built once by the loop, then written as the metric line
    (metrics.jsonl, the ledger with the next checkpoint) and shown by the reporter, as it is.

    ``seconds`` is the step's own time; ``held`` the time the owner held it (kept apart).
    ``tokens`` are the step's target tokens (every rank); ``computed`` the positions this rank
    computed and ``padded`` the padding among them (0: unknown, no padding share or MFU);
    ``attended`` the keys their attention computed (PackedBatch.attended; 0: the row widths);
    ``samples`` the data lines of a skipped step; ``metrics`` a preference objective's fields
    (rewards, margin, accuracy, KL: objective.py)."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    seconds: float
    held: float = 0.0
    skipped: bool = False
    samples: tuple[int, ...] | None = None
    computed: int = 0
    padded: int = 0
    attended: int = 0
    metrics: dict = field(default_factory=dict)


class Recorder:
    def __init__(self, run_id: str, folder: Path, ledger: RunRecords, control: Control, progress: Any, total_steps: int,
                 log_every: int, writes: bool):
        self.run_id, self.dir, self.ledger, self.control = run_id, folder, ledger, control
        self.progress, self.total_steps, self.log_every, self.writes = progress, total_steps, log_every, writes
        self.pending: list[dict] = []   # metric records not yet in the ledger (they go with checkpoints)
        self.evals: dict[int, float] = {}
        self.eval_seconds = 0.0  # of the latest eval, held time left out
        self.reporter: Any = None  # set by the run once the log file is open
        self.work: Any = None      # a throughput.StepWork when the model's FLOPs are countable: MFU

    def _metrics_append(self, record: dict) -> None:
        if not self.writes:
            return
        path, line = self.dir / "metrics.jsonl", json.dumps(record) + "\n"
        try:
            with durable.open_append(path) as fh:  # never through a link planted in the run folder
                fh.write(line)
        except OSError as exc:
            if not durable.is_no_space(exc):
                raise
            raise durable.disk_full(path, len(line), "a metrics line") from None  # a torn line: resume redoes it
        self.pending.append(record)

    def truncate_metrics(self, step: int) -> int:
        """Drop metric lines after ``step``: that work was lost with the process and is done again.
        An eval line at ``step`` itself goes too when the restored state has no result for it: a
        release abandoned that eval, a later process ran it and died before its next checkpoint,
        and the resume runs it again (kept, it would be there twice).

        Returns the last step the previous process had reached (where it was interrupted)."""
        path = self.dir / "metrics.jsonl"
        reached = step
        if path.exists():
            records = []
            for line in path.read_text(errors="replace").splitlines():
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue  # a line torn by the crash (metrics are not fsynced); its step is redone
            reached = max([step] + [r["step"] for r in records])
            kept = [json.dumps(r) + "\n" for r in records
                    if r["step"] < step or (r["step"] == step and (r.get("kind") != "eval" or step in self.evals))]
            durable.atomic_write(path, "".join(kept).encode())
        self.ledger.truncate_metrics(self.run_id, step, eval_kept=step in self.evals)  # a `metrics_truncated` event
        durable.fault_point("after_metrics_truncate")
        return reached

    def step(self, s: StepRecord) -> None:
        """Write a step's metric line and show it (every ``log_every`` steps, the first and the last)."""
        self.control.step = s.step
        if not self.writes:
            return
        line = {"kind": "train", "step": s.step, "loss": s.loss, "grad_norm": s.grad_norm, "lr": s.lr,
                "tokens": s.tokens, "seconds": s.seconds, "time": time.time(), "segment": self.progress.segment}
        line.update(s.metrics)
        if s.held:
            line["held_seconds"] = s.held
        waste = self._waste(s.tokens, s.seconds, s.computed, s.padded, s.attended)
        line.update(waste)
        if s.skipped:
            line["skipped"] = True
            self.ledger.event(self.run_id, "warning", step=s.step, reason="non-finite loss or gradient norm; "
                              "optimizer step skipped", sample_lines=None if s.samples is None else list(s.samples))
        self._metrics_append(line)
        shown = s.step % self.log_every == 0 or s.step == self.total_steps or s.step == 1
        self.reporter.step(s, self.total_steps, show=shown, padding=waste.get("padding"), mfu=waste.get("mfu"))

    def _waste(self, tokens: int, seconds: float, computed: int, padded: int, attended: int = 0) -> dict:
        """The metric line's throughput fields: target tokens/s, and with the positions computed,
        their padding share and the model FLOPs utilisation (train/throughput.py)."""
        fields: dict = {"tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else None}
        if computed > 0:
            fields.update(computed=computed, padded=padded, padding=round(padded / computed, 4))
            mfu = self.work.mfu(computed, padded, seconds, tokens, attended) if self.work is not None else None
            if mfu is not None:
                fields["mfu"] = round(mfu, 4)
            rate = self.work.take_new_rate() if self.work is not None else None
            if rate is not None:  # what MFU divides by, and how it was measured (`lodger show`)
                self.ledger.event(self.run_id, "matmul_rate", step=self.progress.step, **rate)
        return fields

    def spike(self, step: int, loss: float, zscore: float) -> None:
        if self.writes:
            self.ledger.event(self.run_id, "loss_spike", step=step, loss=loss, zscore=round(zscore, 2))

    def has_eval_at(self, step: int) -> bool:
        return step in self.evals

    def eval(self, step: int, result: tuple[float, dict] | None) -> None:
        """Record an eval's (loss, metrics) (loop.evaluate); None: there was none."""
        if result is None:
            return
        loss, metrics = result
        self.evals[step] = loss
        self._metrics_append({"kind": "eval", "step": step, "eval_loss": loss,
                              **{f"eval_{k}": v for k, v in metrics.items()}, "time": time.time(),
                              "segment": self.progress.segment})
        self.reporter.eval_finished(step, loss, self.eval_seconds)

    def message(self, text: str) -> None:
        self.reporter.message(text)
