"""Feeding a training run's trackers as it goes ([report] to): after each checkpoint the ledger
committed, `lodger report RUN` runs in a process of its own (reporting/trackers.py reads the ledger and
writes each tracker), so the run never waits on a tracker nor stops for one. One export at a time:
a commit that comes while one runs is sent by the next; ``close`` sends the last one and waits
for it (bounded), so a finished run's trackers hold every step when `lodger run` returns."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CLOSE_SECONDS = 120.0  # the final export's limit: a tracker that hangs must not hold the run's exit


class TrackerFeed:
    def __init__(self, run_id: str, report):
        self.args = [sys.executable, "-m", "lodger.cli.main", "report", run_id, "--to", ",".join(report.to)]
        if report.dir is not None:
            self.args += ["--dir", str(Path(report.dir).expanduser())]
        if report.mlflow_uri:
            self.args += ["--mlflow-uri", report.mlflow_uri]
        self.proc: subprocess.Popen | None = None
        self.pending = False

    def committed(self) -> None:
        """The ledger committed more of the run: send it, or mark it for the next export."""
        if self.proc is not None and self.proc.poll() is None:
            self.pending = True
            return
        self.pending = False
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env=dict(os.environ), start_new_session=True)

    def close(self) -> None:
        """Send what the ledger holds now, after any export still running, and wait for it."""
        for _ in range(2):  # the running export, then a last one with everything
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=CLOSE_SECONDS)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            if self.proc is not None and not self.pending:
                break
            self.pending = True
            self.committed()
