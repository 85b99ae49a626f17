"""One log format: the fixed step line, to the terminal (with a live progress display) and log.txt.

At a terminal the run shows one live line (step, loss, elapsed, ETA, target tokens/s, time held)
with messages and every ``log_every``-th step line printed above it; elsewhere (a pipe, a file,
``--detach``) the same step lines are printed plainly. ``--quiet`` prints nothing; log.txt always
gets everything. Held time (the owner's) is left out of step times, throughput and the ETA, and
reported on its own.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from pathlib import Path

from . import durable

ETA_WINDOW = 20  # recent steps the ETA is computed from (the first steps are slower: warm-up, caches)


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * 4096
    except OSError:
        return 0


def plural(count: int, noun: str) -> str:
    """1 thread, 2 threads."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def clock(seconds: float | None) -> str:
    """0:07, 3:25, 1:02:03 (h:mm:ss), or "?" while unknown."""
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _waste(padding: float | None, mfu: float | None) -> str:
    """" | pad 46% | mfu 12.3%": what the step's compute was worth, where known."""
    text = f" | pad {padding:.0%}" if padding is not None else ""
    return text + (f" | mfu {mfu:.1%}" if mfu is not None else "")


class Reporter:
    """Prints step lines and messages; a live progress display when stdout is a terminal."""

    def __init__(self, log_path: Path, total: int, start: int, quiet: bool = False, live: bool | None = None):
        self.log = durable.open_append(log_path)  # line-buffered; never through a planted link
        self.quiet = quiet
        self.total, self.first = total, start
        self.began = time.monotonic()
        self.held_total = 0.0
        self.recent: deque[float] = deque(maxlen=ETA_WINDOW)  # step seconds, held time left out
        self.progress = None
        if live is None:
            live = sys.stdout.isatty()
        if live and not quiet:
            from rich.progress import BarColumn, Progress, TextColumn

            # No refresh thread: the display is redrawn at each step and message, so a held run
            # (which takes no steps) uses no CPU for it.
            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=24),
                                     TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[info]}"),
                                     auto_refresh=False, transient=True)
            self.task = self.progress.add_task("training", total=total, completed=start, info="starting")
            self.progress.start()

    def started(self, step: int) -> None:
        """Training starts (or resumes) at ``step``: the ETA counts from here."""
        self.first = step
        self.began = time.monotonic()
        self._show(step, "training", f"elapsed {clock(0)} | eta ?")

    def message(self, text: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self.log.write(f"{stamp} {text}\n")
        if self.quiet:
            return
        if self.progress is not None:
            self.progress.console.print(text, markup=False, highlight=False)
            self.progress.refresh()
        else:
            print(text, flush=True)

    def eta(self, step: int) -> float | None:
        """Seconds left at the pace of the recent steps (held time excluded); None before any step."""
        if not self.recent:
            return None
        return (self.total - step) * sum(self.recent) / len(self.recent)

    def step(self, step: int, total: int, loss: float, grad_norm: float, lr: float, tokens: int,
             seconds: float, show: bool, held: float = 0.0, padding: float | None = None,
             mfu: float | None = None) -> None:
        """``padding``: share of the computed positions that were padding; ``mfu``: model FLOPs
        utilisation (train/throughput.py); either left out of the line when unknown."""
        self.recent.append(seconds)
        self.total = total
        elapsed = time.monotonic() - self.began
        tokens_per_s = tokens / max(seconds, 1e-9)
        line = (f"step {step}/{total} | loss {loss:.4f} | grad_norm {grad_norm:.4f} | lr {lr:.3e} | "
                f"tok/s {tokens_per_s:,.0f}{_waste(padding, mfu)} | {seconds * 1000:.0f} ms/step | "
                f"rss {rss_bytes() / 2**30:.2f} GiB | elapsed {clock(elapsed)} | eta {clock(self.eta(step))}")
        if held:
            line += f" | held {held:.1f} s (not in ms/step)"
        if show:
            self.message(line)
        else:
            self.log.write(line + "\n")
        info = (f"loss {loss:.4f} | {tokens_per_s:,.0f} target tok/s | elapsed {clock(elapsed)} | "
                f"eta {clock(self.eta(step))}")
        if self.held_total:
            info += f" | held {clock(self.held_total)}"
        self._show(step, "training", info)

    def eval_started(self, step: int, examples: int, batches: int) -> None:
        self.message(f"eval at step {step}: {examples} examples in {batches} batches ...")
        self._show(None, f"eval at step {step}", f"{examples} examples")

    def eval_finished(self, step: int, loss: float, seconds: float) -> None:
        self.message(f"eval at step {step}: eval_loss {loss:.4f} ({seconds:.1f} s)")
        self._show(None, "training", None)

    def held(self, by: str | None, reason: str | None) -> None:
        self.message(f"held by {by or '?'} ({reason or 'no reason given'}); memory kept, no CPU used; "
                     "`lodger resume RUN` or the requester continues it")
        self._show(None, "held", None)

    def continued(self, seconds: float) -> None:
        self.held_total += seconds
        self.message(f"continuing after {seconds:.1f} s held (left out of step times and the ETA)")
        self._show(None, "training", None)

    def _show(self, step: int | None, what: str, info: str | None) -> None:
        if self.progress is None:
            return
        fields = {"description": what}
        if step is not None:
            fields["completed"] = step
        if info is not None:
            fields["info"] = info
        self.progress.update(self.task, **fields)
        self.progress.refresh()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        self.log.close()
