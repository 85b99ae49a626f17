"""One log format: the fixed step line, to the terminal (with a live progress display) and log.txt.

At a terminal the run shows one live line (step, loss, elapsed, ETA, target tokens/s, time held),
and a second one while an eval runs (batches done, its ETA), with messages and every
``log_every``-th step line printed above; the clock on them moves every second, so nothing sits
still for longer (the redraw stops while the run is held). Elsewhere (a pipe, a file,
``--detach``) the same step lines are printed plainly, and a long eval says how far it is every
``EVAL_NOTE_EVERY`` seconds. ``--quiet`` prints nothing; log.txt always gets everything. Held time
(the owner's) is left out of step times, throughput and the ETA, and reported on its own.

``Phase`` is the same promise for the long things a command does before or after training
(converting a model, measuring the machine, generating answers).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import durable

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from ..train.record import StepRecord

ETA_WINDOW = 20  # recent steps the ETA is computed from (the first steps are slower: warm-up, caches)
TICK = 1.0  # seconds between redraws of the live line at a terminal
EVAL_NOTE_EVERY = 30.0  # seconds between progress lines of a long eval where there is no live line


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
    """" | pad 46% | mfu 12.3%": what the step's compute was worth, where known.

    An MFU above 100 % is never shown: it would mean the step beat the machine's peak, so it can
    only be a wrong peak (a matmul rate measured while the machine was busy); throughput.StepWork
    measures again and leaves such a value out, and this keeps any that slipped through off the line."""
    text = f" | pad {padding:.0%}" if padding is not None else ""
    return text + (f" | mfu {mfu:.1%}" if mfu is not None and 0 <= mfu <= 1 else "")


def eval_eta(done: int, total: int, seconds: float, since: float = 0.0) -> float | None:
    """Seconds left of an eval at the pace of its first ``done`` batches (``seconds`` for them),
    ``since`` seconds after the last of them ended; None before the first."""
    return max(0.0, (total - done) * seconds / done - since) if done > 0 else None


class Reporter:
    """Prints step lines and messages; a live progress display when stdout is a terminal."""

    def __init__(self, log_path: Path, total: int, start: int, quiet: bool = False, live: bool | None = None):
        hand_over()  # the run's lines take the terminal from a phase that waited for them
        self.log = durable.open_append(log_path)  # line-buffered; never through a planted link
        self.quiet = quiet
        self.total, self.first = total, start
        self.began = time.monotonic()
        self.held_total = 0.0
        self.recent: deque[float] = deque(maxlen=ETA_WINDOW)  # step seconds, held time left out
        self.progress: Progress | None = None  # rich's live lines, at a terminal
        self.eval_task: TaskID | None = None
        self.last: tuple | None = None   # (step, loss, target tokens/s, when): the live line's numbers
        self.started_at: float | None = None  # until then the live line says "starting"
        self.evaluating: dict | None = None
        self.lock = threading.RLock()    # the ticker thread and the loop both redraw
        self.running = threading.Event()  # clear while held: the ticker then waits without a wake-up
        self.closed = threading.Event()
        if live is None:
            live = sys.stdout.isatty()
        if live and not quiet:
            from rich.progress import BarColumn, Progress, TextColumn

            # No refresh thread of rich's: the ticker below redraws once a second while the run
            # trains or evaluates and not at all while it is held (no CPU used then).
            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=24),
                                     TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[info]}"),
                                     auto_refresh=False, transient=True)
            self.task = self.progress.add_task("training", total=total, completed=start, info="starting")
            self.progress.start()
            self.running.set()
            threading.Thread(target=self._tick, name="lodger-live-line", daemon=True).start()

    def started(self, step: int) -> None:
        """Training starts (or resumes) at ``step``: the ETA counts from here."""
        self.first = step
        self.began = self.started_at = time.monotonic()
        self._show(step, "training", self._train_info())

    def message(self, text: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self.log.write(f"{stamp} {text}\n")
        if self.quiet:
            return
        if self.progress is not None:
            with self.lock:
                self.progress.console.print(text, markup=False, highlight=False)
                self.progress.refresh()
        else:
            print(text, flush=True)

    def eta(self, step: int) -> float | None:
        """Seconds left at the pace of the recent steps (held time excluded); None before any step."""
        if not self.recent:
            return None
        return (self.total - step) * sum(self.recent) / len(self.recent)

    def step(self, s: "StepRecord", total: int, show: bool, padding: float | None = None,
             mfu: float | None = None) -> None:
        """The step line of a step's record (train/record.py). ``padding``: share of the computed
        positions that were padding; ``mfu``: model FLOPs utilisation (train/throughput.py);
        either left out of the line when unknown."""
        step, loss, grad_norm, lr, tokens, seconds, held = s.step, s.loss, s.grad_norm, s.lr, s.tokens, s.seconds, s.held
        self.recent.append(seconds)
        self.total = total
        elapsed = time.monotonic() - self.began
        tokens_per_s = tokens / max(seconds, 1e-9)
        line = (f"step {step}/{total} | loss {loss:.4f} | grad_norm {grad_norm:.4f} | lr {lr:.3e} | "
                f"target tok/s {tokens_per_s:,.0f}{_waste(padding, mfu)} | {seconds * 1000:.0f} ms/step | "
                f"rss {rss_bytes() / 2**30:.2f} GiB | elapsed {clock(elapsed)} | eta {clock(self.eta(step))}")
        if held:
            line += f" | held {held:.1f} s (not in ms/step)"
        if show:
            self.message(line)
        else:
            self.log.write(line + "\n")
        self.last = (step, loss, tokens_per_s, time.monotonic())
        self._show(step, "training", self._train_info())

    def _train_info(self) -> str:
        """The live line's text now: the clock runs on between steps, the ETA counts down."""
        now = time.monotonic()
        if self.last is None:
            return f"elapsed {clock(now - self.began)} | eta ?"
        step, loss, tokens_per_s, when = self.last
        eta = self.eta(step)
        eta = None if eta is None else max(0.0, eta - (now - when))
        info = (f"loss {loss:.4f} | {tokens_per_s:,.0f} target tok/s | elapsed {clock(now - self.began)} | "
                f"eta {clock(eta)}")
        if self.held_total:
            info += f" | held {clock(self.held_total)}"
        return info

    def eval_started(self, step: int, examples: int, batches: int) -> None:
        self.message(f"eval at step {step}: {examples} examples in {batches} batches ...")
        now = time.monotonic()
        self.evaluating = {"step": step, "batches": batches, "done": 0, "began": now, "at": now, "noted": now}
        if self.progress is not None:
            with self.lock:
                self.eval_task = self.progress.add_task(f"eval at step {step}", total=batches,
                                                        info=f"batches | {self._eval_info()}")
                self.progress.refresh()

    def eval_progress(self, step: int, done: int, batches: int) -> None:
        """``done`` of the eval's ``batches`` are through: the live line moves; without one, a line
        every ``EVAL_NOTE_EVERY`` seconds (log.txt included) says how far a long eval is."""
        state = self.evaluating
        if state is None or state["step"] != step:
            return
        now = time.monotonic()
        state["done"], state["at"] = done, now
        if self.progress is not None:
            self._redraw()
        elif done < batches and now - state["noted"] >= EVAL_NOTE_EVERY:
            state["noted"] = now
            self.message(f"eval at step {step}: {done}/{batches} batches | {self._eval_info()}")

    def _eval_info(self) -> str:
        state, now = self.evaluating, time.monotonic()
        assert state is not None  # asked only while an eval runs
        eta = eval_eta(state["done"], state["batches"], state["at"] - state["began"], now - state["at"])
        return f"elapsed {clock(now - state['began'])} | eta {clock(eta)}"

    def eval_finished(self, step: int, loss: float, seconds: float) -> None:
        self._end_eval()
        self.message(f"eval at step {step}: eval_loss {loss:.4f} ({seconds:.1f} s)")
        self._show(None, "training", None)

    def _end_eval(self) -> None:
        with self.lock:
            self.evaluating = None
            if self.progress is not None and self.eval_task is not None:
                self.progress.remove_task(self.eval_task)
                self.eval_task = None

    def held(self, by: str | None, reason: str | None) -> None:
        self.running.clear()
        self.message(f"held by {by or '?'} ({reason or 'no reason given'}); memory kept, no CPU used; "
                     "`lodger resume RUN` or the requester continues it")
        self._show(None, "held", None)

    def continued(self, seconds: float) -> None:
        self.held_total += seconds
        self.message(f"continuing after {seconds:.1f} s held (left out of step times and the ETA)")
        self._show(None, "training", None)
        if self.progress is not None:
            self.running.set()

    def _show(self, step: int | None, what: str, info: str | None) -> None:
        if self.progress is None:
            return
        fields: dict[str, Any] = {"description": what}
        if step is not None:
            fields["completed"] = step
        if info is not None:
            fields["info"] = info
        with self.lock:
            self.progress.update(self.task, **fields)
            self.progress.refresh()

    def _redraw(self) -> None:
        """The live lines with the clocks of now."""
        with self.lock:
            if self.progress is None:
                return
            if self.started_at is not None and self.progress.tasks[0].description == "training":
                self.progress.update(self.task, info=self._train_info())
            if self.evaluating is not None and self.eval_task is not None:
                self.progress.update(self.eval_task, completed=self.evaluating["done"],
                                     info=f"batches | {self._eval_info()}")
            self.progress.refresh()

    def _tick(self) -> None:
        while not self.closed.is_set():
            self.running.wait()  # held: sleeps here until continued (or closed)
            if self.closed.wait(TICK):
                return
            if self.running.is_set():
                self._redraw()

    def close(self) -> None:
        self.closed.set()
        self.running.set()  # lets a ticker waiting on a hold see the close
        with self.lock:
            if self.progress is not None:
                self.progress.stop()
                self.progress = None
        self.log.close()


_ACTIVE: list["Phase"] = []  # phases not ended yet, the newest last: one live display at a time


def hand_over() -> None:
    """End the phases still open: what they waited for (a run starting) now speaks for itself."""
    while _ACTIVE:
        _ACTIVE[-1].end()


class Phase:
    """A long piece of work people wait on, said as it happens: at a terminal a live line with its
    clock (and ``expected`` seconds, and items done once ``advance`` is called) from the start and
    a line when it ends; elsewhere a line once it has taken ``after`` seconds and one when it ends.
    Work that ends sooner leaves no line at all (a cache that was already full).

        with Phase("converting the model (once)", expected=20) as phase:
            ...
            phase.advance(3, 10)
    """

    def __init__(self, text: str, *, expected: float | None = None, live: bool | None = None,
                 after: float = 1.0, err: bool = False, quiet: bool = False):
        self.text, self.expected, self.after, self.quiet = text, expected, after, quiet
        self.stream = sys.stderr if err else sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.done: tuple[int, int] | None = None
        self.said = False
        self.began = 0.0
        self.progress: Progress | None = None
        self.timer: threading.Timer | None = None
        self.seconds = self.noted = 0.0
        self.lock, self.ended = threading.Lock(), False  # the timer's start line never follows the end

    def __enter__(self) -> "Phase":
        self.began = self.noted = time.monotonic()
        if self.quiet:
            return self
        _ACTIVE.append(self)
        if self.live:
            from rich.console import Console
            from rich.progress import Progress, ProgressColumn, SpinnerColumn, TextColumn
            from rich.text import Text

            phase = self

            class Clock(ProgressColumn):
                def render(self, task) -> Text:
                    return Text(phase.info())

            # rich's refresh thread (4 redraws a second) only while the phase lasts
            # the clock first: a text too long for the terminal is cut, never the clock
            self.progress = Progress(SpinnerColumn(), Clock(), TextColumn("{task.description}"), transient=True,
                                     console=Console(file=self.stream), refresh_per_second=4)
            self.progress.add_task(self.text, total=None)
            self.progress.start()
        elif self.after <= 0:
            self._say_start()
        else:
            self.timer = threading.Timer(self.after, self._say_start)
            self.timer.daemon = True
            self.timer.start()
        return self

    def info(self) -> str:
        """"3/10 | 0:12 of about 0:20": items done, the clock, what was expected."""
        text = clock(time.monotonic() - self.began) + (f" of about {clock(self.expected)}" if self.expected else "")
        return f"{self.done[0]}/{self.done[1]} | {text}" if self.done is not None else text

    def _say_start(self) -> None:
        with self.lock:
            if self.ended:
                return
            self.said = True
            about = f" (about {clock(self.expected)})" if self.expected else ""
            print(f"{self.text}{about} ...", file=self.stream, flush=True)

    def advance(self, done: int, total: int) -> None:
        """``done`` of ``total`` items are through."""
        self.done = (done, total)
        now = time.monotonic()
        if self.said and not self.live and done < total and now - self.noted >= 5:
            self.noted = now
            print(f"  {self.info()}", file=self.stream, flush=True)

    def __exit__(self, kind, exc, tb) -> None:
        self.end(failed=kind is not None)

    def end(self, failed: bool = False) -> None:
        """Stop the clock and say how long it took (once; a ``Reporter`` starting ends it early)."""
        if self.ended:
            return
        self.seconds = time.monotonic() - self.began
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if self.timer is not None:
            self.timer.cancel()
        with self.lock:
            self.ended = True
        if self.progress is not None:
            progress, self.progress = self.progress, None
            progress.stop()
            self.said = self.seconds >= self.after
        if self.said and not failed:
            print(f"{self.text}: done in {self.seconds:.1f} s", file=self.stream, flush=True)
