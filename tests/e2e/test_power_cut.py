"""A power cut, not a kill: what a cut at any moment of a real run and its resume can leave.

A killed process keeps the page cache: everything it wrote reaches the disk later anyway, so the
kill tests cannot see a missing fsync. Here the standard job is run as a user runs it, SIGKILLed
while it writes its third checkpoint, then `lodger resume`d to the end, both under strace
(tests/syscall_trace.py: every write, sync, creation, rename and removal under $LODGER_HOME, with
its bytes). tests/power_cut.py turns the recording into the states a power cut leaves at every cut
point, under POSIX's rules: only what fsyncs covered; the unsynced operations kept in order up to
a random point; a random subset of them; the write in flight torn. Each state is checked with
lodger's own checks (power_cut_checks.py): the ledger's audit, every row it had reported committed
still there, every checkpoint it recorded present and verifying, metrics.jsonl holding every line
resume keeps, the job file there. A sample goes through the real CLI (`lodger resume`, `lodger
audit`) and must end bitwise equal to the uninterrupted run: weights and every logged number.

`make test` checks every distinct fsync-only state and a sample of the others (a few seconds in
this process); bench/faults.py (LODGER_FAULTS_ALL=1) checks all four kinds at every cut point and
resumes more of them through the CLI.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from faults_helpers import ALL_ENV
from helpers import LODGER, describe, killed_by_sigkill, lodger_env
from power_cut import Disk, read_tree, write_tree
from power_cut_checks import (Checker, assert_resumes_to_the_end, is_ledger, name_need_not_last, names_not_durable,
                              not_shm)
from syscall_trace import Call, Parser, record

pytestmark = [pytest.mark.faults,
              pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (Debian: "
                                 "`apt-get install strace`); the power-cut suite records lodger's system calls with it")]

KILL_AT = "before_manifest@3"
"""The recorded run dies writing its third checkpoint (step 12; steps 4 and 8 committed), as the
shared killed run of the kill tests does; the resume then commits 12 to 24 and the adapter."""
FULL = bool(os.environ.get(ALL_ENV))
SAMPLED_CUTS = 10_000 if FULL else 40
"""Cut points whose other three kinds of state are checked (every cut point's fsync-only state is)."""
CLI_SAMPLE = 6 if FULL else 2


def ledger_op(path: str) -> bool:
    """The ledger's files, and the home folder SQLite fsyncs after creating its journal or WAL."""
    return is_ledger(path) or path == ""


@dataclass
class Recording:
    home: Path
    run_id: str
    calls: list[list[Call]]  # per command
    disk: Disk
    checker: Checker
    seconds: float


def build_disk(initial, calls: list[list[Call]]) -> Disk:
    disk = Disk(initial, watch=ledger_op)
    for command in calls:
        disk.follow(command)
    return disk


@pytest.fixture(scope="module")
def recording(tmp_path_factory, standard_job: Path, baseline) -> Recording:
    folder = tmp_path_factory.mktemp("power_cut")
    home = folder / "home"
    home.mkdir(mode=0o700)
    # The training runtime's measured size, as the fork server shares it (a fresh interpreter importing
    # torch, 5-6 s, that every new home would pay again): part of the state before the recording.
    if (baseline.home / "cache" / "runtime").is_dir():
        shutil.copytree(baseline.home / "cache" / "runtime", home / "cache" / "runtime")
    initial = read_tree(home)
    started = time.monotonic()
    killed = record([LODGER, "run", standard_job, "--quiet"], folder / "run.trace", lodger_env(home, LODGER_FAULT=KILL_AT))
    assert killed_by_sigkill(killed.returncode), describe(killed)
    run_id = killed.stdout.splitlines()[0].split()[1]
    resumed = record([LODGER, "resume", run_id, "--quiet"], folder / "resume.trace", lodger_env(home))
    assert resumed.returncode == 0, describe(resumed)
    calls = [Parser(home).parse(folder / name) for name in ("run.trace", "resume.trace")]
    disk = build_disk(initial, calls)
    misread = disk.check_against(home, ignore=lambda path: not not_shm(path))
    assert not misread, "the model of the recording differs from the disk:\n" + "\n".join(misread)
    return Recording(home, run_id, calls, disk, Checker(disk, run_id, folder / "scratch"), time.monotonic() - started)


def report_cuts(disk: Disk) -> list[int]:
    """The moments lodger had just told someone something: each ledger call returned."""
    return [cut for cut, _ in disk.watched]


def test_every_name_lodger_makes_is_durable_before_the_ledger_reports_anything(recording: Recording) -> None:
    """no file or folder lodger made, renamed or removed is missing (or back) after a cut at a report"""
    disk = recording.disk
    assert len(report_cuts(disk)) > 10, "the recording has too few ledger commits to say anything"
    found = names_not_durable(disk, report_cuts(disk), ignore=name_need_not_last)
    assert not found, "names not durable when the ledger reported:\n" + "\n".join(
        f"  {path}: {why}" for path, why in found.items())


def _check(checker: Checker, disk: Disk, kinds: str) -> tuple[int, int, dict[str, str]]:
    """Check the fsync-only state at every cut, and (``kinds`` "all") the other three at sampled cuts;
    return (states checked, states that held, each problem with where it was first seen)."""
    problems: dict[str, str] = {}
    states = held = 0

    def check(tree, cut: int, label: str) -> None:
        nonlocal states, held
        found = checker.problems(tree, cut)
        states, held = states + 1, held + (not found)
        for problem in found:
            problems.setdefault(problem, f"{disk.describe_cut(cut)}: {label}")

    for cut in range(disk.cuts):
        check(disk.state(cut), cut, "only what fsyncs covered")
    if kinds == "all":
        rng = random.Random(34)
        for cut in sorted(rng.sample(range(disk.cuts), min(SAMPLED_CUTS, disk.cuts))):
            for label, tree in list(disk.variants(cut, random.Random(cut)))[1:]:
                check(tree, cut, label)
    return states, held, problems


def test_a_power_cut_anywhere_keeps_every_reported_record_and_a_checkpoint_that_verifies(recording: Recording) -> None:
    """every state a cut leaves audits clean, keeps each reported row, checkpoint and metric line"""
    disk, checker = recording.disk, recording.checker
    started = time.monotonic()
    states, held, problems = _check(checker, disk, "all")
    print(f"power cut: {states} states, {held} held ({checker.checked} distinct; {len(disk.ops)} operations "
          f"recorded in {recording.seconds:.0f} s, checked in {time.monotonic() - started:.1f} s)")
    assert not problems, f"{len(problems)} problem(s) after a power cut:\n" + "\n".join(
        f"  {where}:\n    {problem}" for problem, where in problems.items())


def _cli_picks(recording: Recording) -> list[tuple[str, int, int]]:
    """(why, cut, variant index) of the states resumed through the CLI: the fsync-only state just after
    the ledger recorded checkpoint 8 (the killed run's newest), then states drawn from the resume."""
    disk, checker = recording.disk, recording.checker
    after_8 = next(cut for cut in report_cuts(disk) if checker.reported(cut).checkpoint == 8)
    picks = [("the killed run's newest checkpoint just recorded", after_8, 0)]
    rng = random.Random(3400)
    resume = [cut for cut in report_cuts(disk) if disk.ops[cut - 1].segment == 1
              and (checker.reported(cut).checkpoint or 0) < 24]
    for cut in sorted(rng.sample(resume, min(CLI_SAMPLE - 1, len(resume)))):
        picks.append(("during the resume", cut, rng.randrange(4)))
    return picks


def test_resumed_after_a_power_cut_the_run_ends_bitwise_equal_to_the_uninterrupted_one(
        recording: Recording, baseline, tmp_path: Path) -> None:
    """`lodger resume` from sampled cut states finishes; weights and every logged number equal the baseline's"""
    disk = recording.disk
    for n, (why, cut, variant) in enumerate(_cli_picks(recording)):
        states = list(disk.variants(cut, random.Random(cut)))  # three when no write was pending: none to tear
        label, tree = states[min(variant, len(states) - 1)]
        home = write_tree(tree, tmp_path / f"home-{n}", keep=not_shm)
        assert_resumes_to_the_end(home, recording.run_id, baseline, f"{why}, {disk.describe_cut(cut)}: {label}")


# flaw -> which fsync calls are left out of the recording (as if lodger never made them)
PLANTED = {
    "no fsync of a checkpoint's files before the rename": lambda call, calls, i: (
        "/checkpoints/.tmp-" in call.path and call.path.count("/") == 4),
    "no fsync of the temporary folder": lambda call, calls, i: (
        "/checkpoints/.tmp-" in call.path and call.path.count("/") == 3),
    "no fsync of the parent after the rename": lambda call, calls, i: (
        call.path.endswith("/checkpoints") and _before(calls, i).name == "rename"
        and "/checkpoints/step-" in _before(calls, i).dest),
    # SQLite in WAL mode with synchronous=NORMAL syncs the WAL only before it copies it into the
    # database (a checkpoint), not at each commit: the commits it reported since can be lost.
    "the ledger's commits not fsynced (synchronous=NORMAL)": lambda call, calls, i: (
        call.path == "ledger.db-wal" and not (_after(calls, i).name == "write" and _after(calls, i).path == "ledger.db")),
}


def _before(calls: list[Call], i: int) -> Call:
    """The call before ``calls[i]`` that changed something (opening a folder to fsync it does not)."""
    return next(c for c in reversed(calls[:i]) if c.name != "open")


def _after(calls: list[Call], i: int) -> Call:
    """The call after ``calls[i]`` that changed something (or ``calls[i]`` itself at the end)."""
    return next((c for c in calls[i + 1:] if c.name != "open"), calls[i])


@pytest.mark.parametrize("flaw", PLANTED, ids=list(PLANTED))
def test_a_planted_missing_fsync_is_caught_by_a_power_cut_and_not_by_a_kill(recording: Recording, flaw: str,
                                                                            tmp_path: Path) -> None:
    """the states of a recording with those fsyncs removed fail the checks; its kill states pass"""
    drop = PLANTED[flaw]
    run = recording.calls[0]  # the killed run alone: it commits checkpoints 4 and 8, enough to show each flaw
    calls = [[c for i, c in enumerate(run) if not (c.name == "fsync" and drop(c, run, i))]]
    dropped = len(run) - len(calls[0])
    assert dropped >= 2, f"{flaw}: only {dropped} fsync(s) matched; the recording changed shape"
    disk = build_disk(recording.disk.initial, calls)
    checker = Checker(disk, recording.run_id, tmp_path / "scratch")
    _, _, problems = _check(checker, disk, "fsync-only")
    assert problems, f"{flaw}: no power-cut state shows it"
    print(f"{flaw}: {len(problems)} problem(s), e.g. {next(iter(problems))}")
    killed = {p for cut in report_cuts(disk) for p in checker.problems(disk.kill(cut), cut)}
    assert not killed, f"{flaw}: a kill already shows it (the power cut adds nothing): {sorted(killed)[:3]}"

