"""How a running job is told to stop, and how it answers.

SIGTERM or a first Ctrl-C asks for a checkpoint at the next step boundary and a clean exit;
a second Ctrl-C exits at once. The loop calls ``checkpoint_boundary()`` at every micro-step; it
costs an attribute read unless something was requested.
"""

from __future__ import annotations

import os
import signal


class Control:
    """Requests from outside (signals) that the loop answers at step boundaries."""

    def __init__(self):
        self.stop: str | None = None  # the reason a stop was requested, if it was
        self._interrupts = 0

    def request_stop(self, reason: str) -> None:
        if self.stop is None:
            self.stop = reason

    def install_signal_handlers(self) -> "Control":
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_int)
        return self

    def checkpoint_boundary(self) -> None:
        """Called between micro-steps; the place where a pause could be honoured."""

    def _on_term(self, signum, frame) -> None:
        self.request_stop("SIGTERM")

    def _on_int(self, signum, frame) -> None:
        self._interrupts += 1
        if self._interrupts >= 2:
            os.write(2, b"\nsecond Ctrl-C: exiting now without a checkpoint\n")
            os._exit(130)
        os.write(2, b"\nCtrl-C: committing a checkpoint at the next step boundary (Ctrl-C again to quit now)\n")
        self.request_stop("SIGINT")
