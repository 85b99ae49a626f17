"""A run as people see it: the live step (from the running process) beside the last checkpoint's.

The ledger's ``step`` is the step of the newest committed checkpoint: it moves only when one is
written. The process itself is further on; its newest step is the last train record of
``metrics.jsonl`` (appended after every step). ``status``, ``ls`` and ``show`` read both and say
which is which. No torch here: these commands must start in a blink.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

TAIL_BYTES = 64 * 1024  # the end of metrics.jsonl holds the newest records; never read it all


def newest_records(folder: Path) -> tuple[dict | None, dict | None]:
    """(newest train record, newest eval record) of a run folder's metrics.jsonl, read from its end."""
    path = Path(folder) / "metrics.jsonl"
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - TAIL_BYTES))
            chunk = fh.read()
    except OSError:
        return None, None
    train = evaluation = None
    lines = chunk.split(b"\n")
    if size > TAIL_BYTES:
        lines = lines[1:]  # the first piece may be the end of a line cut by the seek
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # empty, or a line being written right now
        if record.get("kind") == "train" and train is None:
            train = record
        elif record.get("kind") == "eval" and evaluation is None:
            evaluation = record
        if train is not None and evaluation is not None:
            break
    return train, evaluation


def progress(run: dict, folder: Path | None) -> dict:
    """Where a run stands: ``step`` (newest logged), ``checkpoint_step`` (newest committed), loss.

    For a remote run (or one without a local folder) both are the ledger's, as of the last sync."""
    info = {"step": run["step"], "checkpoint_step": run["step"], "total_steps": run["total_steps"],
            "loss": run.get("loss"), "eval_loss": None, "eval_step": None}
    if folder is None or run.get("target"):
        return info
    train, evaluation = newest_records(folder)
    if train is not None and train.get("step", -1) >= run["step"]:
        info["step"], info["loss"] = train["step"], train.get("loss")
    if evaluation is not None:
        info["eval_loss"], info["eval_step"] = evaluation.get("eval_loss"), evaluation.get("step")
    return info


def live_status(run: dict) -> str:
    """The recorded status, corrected for a process that died without saying so or is starting."""
    from ..home import run_dir
    from ..owner.runlock import is_locked

    if run.get("target"):
        return run["status"]  # a remote run: as refresh_remote left it (its cluster was asked)
    folder = run_dir(run["id"])
    if run["status"] in ("running", "held") and not is_locked(folder):
        return "crashed"
    if run["status"] in ("created", "paused", "interrupted") and is_locked(folder):
        from ..owner.control import run_state
        from ..owner.runlock import lock_pid

        # A new process has taken the run and is loading (it says "running" once it trains); the
        # process that just paused it still holds the lock for a moment, but it wrote the state.
        if run_state(folder).get("pid") != lock_pid(folder):
            return "starting"
    return run["status"]


def step_text(info: dict) -> str:
    """"14/24 (ckpt 12)"; just "24/24" when the newest checkpoint is at the newest step."""
    text = f"{info['step']}/{info['total_steps']}"
    if info["checkpoint_step"] != info["step"]:
        text += f" (ckpt {info['checkpoint_step']})"
    return text


def loss_text(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"


def table(rows: list[list[str]], header: list[str], width: int | None, keep: int = 2) -> list[str]:
    """Align ``rows`` under ``header`` in at most ``width`` characters (None: no limit).

    Columns are listed in order of importance: the last ones are dropped first when the width is
    short, and the first ``keep`` (the run id and its status) are always shown whole, never cut,
    even if the line is then longer than ``width``: an id is for copying."""
    gap = 2
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    shown = len(header)
    if width is not None:
        while shown > keep and sum(widths[:shown]) + gap * (shown - 1) > width:
            shown -= 1
    lines = []
    for cells in [header, *rows]:
        parts = [str(cell).ljust(widths[i]) for i, cell in enumerate(cells[:shown])]
        lines.append((" " * gap).join(parts).rstrip())
    return lines


def rate_conditions(rate: dict) -> str:
    """How a matmul rate was measured (train/throughput.measure_once's record), in words:
    "quiet: other processes used 2% of the CPUs meanwhile; load average 0.41"."""
    others = rate.get("others")
    busy = "quiet" if rate.get("quiet") else "busy"
    if others is not None:
        share = f"other processes used {others:.0%} of the CPUs meanwhile"
    elif "others" in rate:
        share = "what else ran is not known here"
    else:
        share = "measured before lodger recorded the conditions"
    tries = f"; best of {rate['tries']} tries" if rate.get("tries", 1) > 1 else ""
    load = f"; load average {rate['load']:.2f}" if rate.get("load") is not None else ""
    return f"{busy}: {share}{load}{tries}"


def rate_text(rate: dict) -> str:
    """`lodger show`'s line on the rate MFU divides by: "61.2 GFLOP/s (fp32, 2 threads, cpu) from a
    0.2 s matmul benchmark at 2026-12-02 15:22:03 (cached), quiet: ..."."""
    when = rate.get("measured_at")
    at = f" at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(when))}" if when else ""
    how = "cached" if rate.get("cached") else "measured by this run"
    if rate.get("reason"):
        how = f"measured again: {rate['reason']}"
    seconds = f"{rate['seconds']:.1f} s " if rate.get("seconds") is not None else ""
    return (f"{rate['flops_per_second'] / 1e9:.1f} GFLOP/s ({rate.get('precision', '?')}, "
            f"{rate.get('threads', '?')} threads, {rate.get('device', '?')}) from a {seconds}matmul benchmark"
            f"{at} ({how}), {rate_conditions(rate)}")
