"""A run's curves: every numeric field of its metric lines, read once and then only what was appended.

Fields are taken as they come (loss, lr, tokens_per_s, mfu, a preference run's rewards, GRPO's
``reward/<fn>``...), so a new objective's numbers appear on the page without a change here. A step
logged again (a run resumed from an earlier checkpoint redoes the steps after it) replaces the lost
ones from that step on, as in the ledger. What the browser gets is downsampled: per bucket of
steps, the points where each field is smallest and largest, so a spike survives and a million
points cost the browser a few thousand.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from array import array
from pathlib import Path

SKIPPED = ("kind", "step", "time", "segment")
READ_CHUNK = 8 * 2**20


class Column:
    """The steps and the numeric fields of one kind of record (train or eval), as float arrays."""

    def __init__(self):
        self.steps = array("d")
        self.fields: dict[str, array] = {}

    def add(self, record: dict) -> None:
        step = record.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            return
        if self.steps and step <= self.steps[-1]:
            self.truncate(bisect.bisect_left(self.steps, step))
        self.steps.append(step)
        size = len(self.steps)
        for key, value in record.items():
            if key in SKIPPED or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            column = self.fields.get(key)
            if column is None:
                column = self.fields[key] = array("d", [math.nan]) * (size - 1)
            column.append(value)
        for column in self.fields.values():
            if len(column) < size:
                column.append(math.nan)

    def truncate(self, keep: int) -> None:
        del self.steps[keep:]
        for column in self.fields.values():
            del column[keep:]


class Series:
    """One run's metrics.jsonl: parsed once, then only its new complete lines at each refresh."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.identity: tuple[int, int] | None = None
        self._reset()

    def _reset(self) -> None:
        self.offset = 0
        self.kinds = {"train": Column(), "eval": Column()}

    def refresh(self) -> bool:
        """Read what was appended since the last call; True when something was."""
        try:
            stat = os.stat(self.path)
        except OSError:
            return False
        if (stat.st_dev, stat.st_ino) != self.identity or stat.st_size < self.offset:
            self._reset()  # a new or shortened file: start again
            self.identity = (stat.st_dev, stat.st_ino)
        if stat.st_size == self.offset:
            return False
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            while True:
                chunk = fh.read(READ_CHUNK)
                end = chunk.rfind(b"\n") + 1
                if end == 0:
                    break  # no complete line yet: a line being written is read once it ends
                for line in chunk[:end].split(b"\n"):
                    self._add(line)
                self.offset += end
                fh.seek(self.offset)
                if len(chunk) < READ_CHUNK:
                    break
        return True

    def _add(self, line: bytes) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            return
        if isinstance(record, dict) and record.get("kind") in self.kinds:
            self.kinds[record["kind"]].add(record)

    def points(self, kind: str, width: int) -> dict:
        """{"steps": [...], "fields": {name: [...]}} with at most about 2 points per field per bucket."""
        column = self.kinds[kind]
        keep = downsample(column, width)
        steps = [column.steps[i] for i in keep] if keep is not None else list(column.steps)
        fields = {name: _json_numbers(values, keep) for name, values in column.fields.items()}
        return {"steps": steps, "fields": fields, "total": len(column.steps)}


def downsample(column: Column, width: int) -> list[int] | None:
    """Indices to keep: in each of ``width`` buckets, each field's smallest and largest value and the
    bucket's first point; None when there are few enough points to send them all."""
    n = len(column.steps)
    if n <= 2 * width:
        return None
    import numpy as np

    per = math.ceil(n / width)
    buckets = math.ceil(n / per)
    pad = buckets * per - n
    keep = {0, n - 1, *range(0, n, per)}
    for values in column.fields.values():
        data = np.frombuffer(values, dtype=np.float64)
        grid = np.concatenate([data, np.full(pad, np.nan)]).reshape(buckets, per)
        missing = np.isnan(grid)
        base = np.arange(buckets) * per
        for pick, fill in ((np.argmin, np.inf), (np.argmax, -np.inf)):
            chosen = pick(np.where(missing, fill, grid), axis=1)
            ok = ~missing[np.arange(buckets), chosen]
            keep.update((base + chosen)[ok].tolist())
    return sorted(i for i in keep if i < n)


def _json_numbers(values: array, keep: list[int] | None) -> list[float | None]:
    picked = values if keep is None else (values[i] for i in keep)
    return [None if math.isnan(v) or math.isinf(v) else v for v in picked]


class SeriesCache:
    """Series per run folder, kept while the server runs (each file read once, then its tail)."""

    def __init__(self):
        self.series: dict[str, Series] = {}

    def get(self, folder: Path) -> Series:
        key = str(folder)
        if key not in self.series:
            self.series[key] = Series(Path(folder) / "metrics.jsonl")
        found = self.series[key]
        found.refresh()
        return found
