"""The fault and adversary suite, every case, with figures: one line per case and a summary.

    python bench/faults.py                 # every case of the suite, the expensive ones included
    python bench/faults.py --fast          # only what `make test` runs
    python bench/faults.py --with-planned  # also the faults planned for earlier (kills at every
                                           # checkpoint fault point, damaged checkpoints, bad lines,
                                           # an edited ledger, stale lock pids, ...), counted alike
    python bench/faults.py -k serve        # a pytest -k selection

Prints, for each case (a test of tests/e2e/test_faults_*.py, tests/unit/test_faults_*.py and the
power-cut suite, tests/e2e/test_power_cut*.py):

    fault <name>: held (<what was checked>, 12.3 s)
    fault <name>: BROKEN (<what was checked>, 4.0 s)
    fault <name>: skipped (<why>)

then `faults: N tried, N held` (and how many were skipped, e.g. a full disk where no tmpfs can be
mounted). Exit 0 when every case tried held. The cases run in this process through pytest (the
tests are the cases: one definition, run by `make test` and here), with LODGER_FAULTS_ALL=1 so
that the expensive ones (a 2 GiB line, 10^6 lines) run too; their own figures (peak memory,
seconds) are printed with `#` in front, but for the power-cut model's tally, `power cut: N states,
N held` (every cut point of a recorded run and resume, four kinds of state at each), and each
real-file-system trial is a case of its own (`fault ext4_shut_down_...[<fault point>]`). Seconds
include each case's share of shared set-up (a module's trained run is paid by its first case) on
whatever else the machine was doing: a measure, not a bound.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = ["tests/e2e/test_faults_disk.py", "tests/e2e/test_faults_files.py", "tests/e2e/test_faults_kill.py",
         "tests/e2e/test_faults_race.py", "tests/e2e/test_faults_serve.py", "tests/e2e/test_faults_forgery.py",
         "tests/e2e/test_power_cut.py", "tests/e2e/test_power_cut_ext4.py",
         "tests/unit/test_faults_enospc.py", "tests/unit/test_faults_links.py", "tests/unit/test_faults_federated.py"]
PLANNED = ["tests/e2e/test_resume_exact.py", "tests/e2e/test_ledger_recovery.py", "tests/e2e/test_signal_safety.py",
           "tests/e2e/test_chain.py", "tests/unit/test_power_loss.py", "tests/unit/test_faults.py",
           "tests/e2e/test_bad_input_corpus.py::test_each_damaged_checkpoint_is_named_moved_aside_and_the_newest_good_one_used",
           "tests/e2e/test_storage.py::test_an_upload_killed_before_its_manifest_leaves_no_checkpoint"]
"""Faults planned for before this suite, tried by tests of their own (`--with-planned` counts them)."""


class Tally:
    """A pytest plugin: what each case checked (its docstring's first line), how it ended, how long."""

    def __init__(self):
        self.checked: dict[str, str] = {}
        self.order: list[str] = []
        self.outcome: dict[str, str] = {}
        self.why: dict[str, str] = {}
        self.seconds: dict[str, float] = {}
        self.printed: set[str] = set()
        self.failures: dict[str, list[str]] = {}

    def pytest_collection_modifyitems(self, items):
        for item in items:
            function = getattr(item, "function", None)
            doc = (function.__doc__ or "").strip().split("\n\n")[0].splitlines() if function is not None else []
            self.checked[item.nodeid] = " ".join(line.strip() for line in doc if line.strip()) or item.name
            self.order.append(item.nodeid)

    def pytest_runtest_logreport(self, report):
        node = report.nodeid
        self.seconds[node] = self.seconds.get(node, 0.0) + report.duration
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            if report.skipped:
                self.outcome[node] = "skipped"
                self.why[node] = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
            else:
                self.outcome[node] = "held" if report.passed else "BROKEN"
        elif report.when == "teardown" and report.failed:
            self.outcome[node] = "BROKEN"
        for text in (report.capstdout or "").splitlines():
            if text.strip() and report.when == "call":  # the power-cut tally is a result line of its own
                print(text.strip() if text.startswith("power cut:") else f"# {text.strip()}", flush=True)
        if report.failed:
            self.failures.setdefault(node, []).append(report.longreprtext)
        if report.when == "teardown" and node not in self.printed:
            self.printed.add(node)
            self._line(node)
            for text in self.failures.get(node, []):
                print("\n".join(f"#   {line}" for line in text.splitlines()[-25:]), flush=True)

    def _line(self, node: str) -> None:
        name = node.split("::", 1)[1].removeprefix("test_") if "::" in node else node
        outcome = self.outcome.get(node, "BROKEN")
        if outcome == "skipped":
            print(f"fault {name}: skipped ({self.why.get(node, '')})", flush=True)
            return
        print(f"fault {name}: {outcome} ({self.checked.get(node, name)}, {self.seconds.get(node, 0.0):.1f} s)",
              flush=True)

    def summary(self) -> tuple[int, int, int]:
        done = [n for n in self.order if n in self.outcome]
        tried = [n for n in done if self.outcome[n] != "skipped"]
        held = [n for n in tried if self.outcome[n] == "held"]
        return len(tried), len(held), len(done) - len(tried)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="only the cases `make test` runs")
    parser.add_argument("--with-planned", action="store_true", help="also the tests of the faults planned earlier")
    parser.add_argument("-k", dest="select", default=None, help="a pytest -k expression")
    args = parser.parse_args()
    os.chdir(ROOT)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.fast:
        os.environ.pop("LODGER_FAULTS_ALL", None)
    else:
        os.environ["LODGER_FAULTS_ALL"] = "1"
    sys.path.insert(0, str(ROOT / "src"))
    import pytest

    tally = Tally()
    targets = SUITE + (PLANNED if args.with_planned else [])
    # No terminal reporter: the lines below are the output (a broken case's failure is printed with it).
    pytest_args = [*targets, "-p", "no:terminal", "-p", "no:cacheprovider", "-o", "addopts=", "-m",
                   "not slow and not gpu", "--capture=fd"]
    if args.select:
        pytest_args += ["-k", args.select]
    started = time.monotonic()
    print(f"# fault suite: {len(targets)} files; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
          flush=True)
    code = pytest.main(pytest_args, plugins=[tally])
    tried, held, skipped = tally.summary()
    extra = f", {skipped} skipped" if skipped else ""
    print(f"faults: {tried} tried, {held} held{extra} ({time.monotonic() - started:.0f} s)", flush=True)
    if code not in (0, 1):  # 2-4: interrupted, internal error, usage error, no tests collected
        print(f"faults: pytest ended with exit code {code} (collection or usage error)", flush=True)
        return 1
    return 0 if tried and tried == held else 1


if __name__ == "__main__":
    sys.exit(main())
