"""One log format: the fixed step line, to the terminal (with a rich progress bar) and log.txt."""

from __future__ import annotations

import sys
import time
from pathlib import Path


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * 4096
    except OSError:
        return 0


class Reporter:
    """Prints step lines and messages; shows a progress bar with ETA when stdout is a terminal."""

    def __init__(self, log_path: Path, total: int, start: int, quiet: bool = False):
        self.log = open(log_path, "a", buffering=1, encoding="utf-8")
        self.quiet = quiet
        self.progress = None
        if sys.stdout.isatty() and not quiet:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[loss]}"), TimeRemainingColumn(), transient=True)
            self.task = self.progress.add_task("train", total=total, completed=start, loss="")
            self.progress.start()

    def message(self, text: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self.log.write(f"{stamp} {text}\n")
        if self.quiet:
            return
        if self.progress is not None:
            self.progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def step(self, step: int, total: int, loss: float, grad_norm: float, lr: float, tokens_per_s: float,
             seconds: float, show: bool) -> None:
        line = (f"step {step}/{total} | loss {loss:.4f} | grad_norm {grad_norm:.4f} | lr {lr:.3e} | "
                f"tok/s {tokens_per_s:,.0f} | {seconds * 1000:.0f} ms/step | rss {rss_bytes() / 2**30:.2f} GiB")
        if show:
            self.message(line)
        else:
            self.log.write(line + "\n")
        if self.progress is not None:
            self.progress.update(self.task, completed=step, loss=f"loss {loss:.4f}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.log.close()
