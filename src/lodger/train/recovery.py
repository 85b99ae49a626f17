"""Bring the ledger level with what a run's folder proves happened.

A checkpoint is committed by a rename; the ledger hears of it (the interval's metrics, the run's
step, a ``checkpoint`` event) in a transaction just after. A process killed between the two leaves
a committed checkpoint the ledger never heard of, and metric lines that only ``metrics.jsonl``
holds. The checkpoint is what the run resumes from, so at resume the ledger is completed from the
run folder: every metric line up to the restored step that the ledger lacks (or holds differently)
is ingested, and the checkpoint gets its event, marked ``recovered``.

``metrics.jsonl`` is fsynced before each checkpoint is committed, so after a power cut as after a
kill it holds every line up to the newest committed checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import durable

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint
    from ..ledger import Ledger

METRICS_FILE = "metrics.jsonl"

LEDGER_FAULT_POINTS = ("after_create_run", "checkpoint_before_ledger", "checkpoint_after_ledger",
                       "after_metrics_truncate", "after_ledger_recovery")
"""Named places around the ledger writes of a run (see durable.fault_point): after the run's row is
created (before any process trained it); after a checkpoint's commit and before its ledger write;
after that write; after resume dropped the ledger's metric rows past the restored step; after resume
completed the ledger from the run folder."""


def read_metric_lines(folder: Path) -> list[dict]:
    """The records of a run's metrics.jsonl; a line torn by a crash is skipped (its step is redone)."""
    path = Path(folder) / METRICS_FILE
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def sync_metrics(folder: Path) -> None:
    """Make metrics.jsonl durable before a checkpoint that covers its lines is committed."""
    path = Path(folder) / METRICS_FILE
    if path.exists():
        durable.fsync_file(path)


def complete_ledger(ledger: Ledger, run_id: str, folder: Path, checkpoint: Checkpoint) -> dict[str, Any]:
    """Ingest the metric lines up to ``checkpoint.step`` that the ledger lacks, and record the
    checkpoint if the ledger never heard of it; one transaction. Returns what was added."""
    step = checkpoint.step
    wanted = [r for r in read_metric_lines(folder) if r["step"] <= step]
    have = {(kind, m["step"]): m for kind in ("train", "eval") for m in ledger.metrics(run_id, kind)}
    missing = [r for r in wanted if have.get((r.get("kind", "train"), r["step"])) != r]
    known = _checkpoint_recorded(ledger, run_id, checkpoint)
    if not missing and known:
        return {"metrics": 0, "checkpoint": False}
    with ledger.transaction():
        for segment in sorted({r.get("segment", 0) for r in missing}):
            ledger.add_metrics(run_id, segment, [r for r in missing if r.get("segment", 0) == segment])
        if not known:
            losses = [r["loss"] for r in wanted if r.get("kind", "train") == "train" and "loss" in r]
            # the event sets the run's step and loss columns (ledger/records.py), as a live checkpoint's does
            ledger.event(run_id, "checkpoint", step=step, path=checkpoint.path.name, recovered=True,
                         loss=losses[-1] if losses else None,
                         bytes=sum(f.stat().st_size for f in checkpoint.path.iterdir()),
                         metrics_recovered=len(missing))
    durable.fault_point("after_ledger_recovery")
    return {"metrics": len(missing), "checkpoint": not known}


def _checkpoint_recorded(ledger: Ledger, run_id: str, checkpoint: Checkpoint) -> bool:
    """Whether a ``checkpoint`` event names this very folder: same step, written after its manifest
    (an older checkpoint of the same step, since moved aside as damaged, does not count)."""
    created = float(checkpoint.manifest.get("created") or 0.0)
    return any(e["kind"] == "checkpoint" and e["data"].get("step") == checkpoint.step
               and e["data"].get("path") == checkpoint.path.name and e["time"] >= created
               for e in ledger.events(run_id))
