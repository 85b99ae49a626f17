"""What the power-cut suite (test_power_cut.py) asks of every state a cut can leave, with lodger's
own checks: its checkpoint verification (CheckpointStore), its ledger's audit, and what `lodger
resume` reads back (metrics.jsonl, job.toml).

What the ledger had *reported committed* at a cut is read from the live ledger files at the last
moment before the cut when no ledger call was under way (``Disk.watched``: the boundary after a
run of writes and syncs to ledger.db*). With ``synchronous=FULL`` a commit returns only after the
WAL's fdatasync, so everything visible then had been made durable; a setting that returned earlier
(``NORMAL``) would show here as rows reported and lost.
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from helpers import describe, final_adapter_bytes, lodger_env, read_metrics, run_lodger
from lodger.checkpoint import CheckpointStore
from lodger.errors import CheckpointError, LedgerError
from lodger.ledger import Ledger
from power_cut import Disk, Tree, tree_get, write_tree

LEDGER = "ledger.db"
SHM = "ledger.db-shm"
TIMINGS = ("time", "seconds", "tokens_per_s", "mfu", "held_seconds", "segment")
"""Fields of a metric line that measure the machine, not the run: left out of bitwise comparisons."""


def is_ledger(path: str) -> bool:
    return path == LEDGER or path.startswith(LEDGER + "-")


def not_shm(path: str) -> bool:
    """SQLite's shared-memory index: mapped into memory (its writes never pass through write(2)), and
    rebuilt from the WAL by the first connection after a reboot, so no state carries it."""
    return path != SHM


_TEMPORARY = re.compile(r"^\.(tmp-|trash-|adapter-tmp-|.+\.tmp-)")


def name_need_not_last(path: str) -> bool:
    """Names whose durability is not lodger's promise: SQLite's own -wal, -journal and -shm (SQLite
    fsyncs the folder when it creates them and the checks above judge the ledger it leaves), and
    lodger's temporaries (``.tmp-*``, ``.NAME.tmp-PID``, ``.trash-*``): never read as what they will
    become, removed when found after a crash."""
    return path in (SHM, LEDGER + "-wal", LEDGER + "-journal") or any(
        _TEMPORARY.match(part) for part in path.split("/"))


@dataclass
class Reported:
    """What the ledger had told its callers was committed, at one boundary."""

    events: dict[int, str] = field(default_factory=dict)  # seq -> hash
    checkpoint: int | None = None  # the newest checkpoint step it recorded for the run


def metric_records(data: bytes | None) -> dict[tuple[str, int], dict]:
    """metrics.jsonl's records by (kind, step), as resume reads them (a torn line is skipped)."""
    found: dict[tuple[str, int], dict] = {}
    for line in (data or b"").decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            found[(record.get("kind", "train"), record["step"])] = record
    return found


def exact(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMINGS}


class Checker:
    """Checks the states of one recorded run (``run_id``) against what it reported and its end."""

    def __init__(self, disk: Disk, run_id: str, scratch: Path):
        self.disk, self.run_id, self.scratch = disk, run_id, scratch
        final = disk.live()
        self.metrics = metric_records(tree_get(final, f"runs/{run_id}/metrics.jsonl"))  # type: ignore[arg-type]
        self.job = tree_get(final, f"runs/{run_id}/job.toml")
        self._reported: dict[int, Reported] = {}
        self._seen: dict[tuple, list[str]] = {}
        self.checked = 0

    # -- what the ledger had reported -------------------------------------------------------
    def reported(self, cut: int) -> Reported:
        index = max([n for n, (at, _) in enumerate(self.disk.watched) if at <= cut], default=-1)
        if index < 0:
            return Reported()
        if index not in self._reported:
            files = self.disk.watched[index][1]
            folder = write_tree({k: v for k, v in files.items() if not_shm(k)}, self.scratch / f"reported-{index}")
            self._reported[index] = reported_by(folder / LEDGER, self.run_id)
            shutil.rmtree(folder)
        return self._reported[index]

    # -- one state -------------------------------------------------------------------------
    def problems(self, tree: Tree, cut: int) -> list[str]:
        """What is wrong with ``tree``, a state a cut at ``cut`` can leave (memoised by content)."""
        run = f"runs/{self.run_id}"
        parts = ("ledger", {k: v for k, v in tree.items() if is_ledger(k) and not_shm(k)},
                 tree_get(tree, f"{run}/checkpoints"), tree_get(tree, f"{run}/metrics.jsonl"),
                 tree_get(tree, f"{run}/job.toml"))
        reported = self.reported(cut)
        key = (_freeze(parts), tuple(sorted(reported.events.items())), reported.checkpoint)
        if key not in self._seen:
            self.checked += 1
            self._seen[key] = self._problems(tree, reported)
        return self._seen[key]

    def _problems(self, tree: Tree, reported: Reported) -> list[str]:
        return state_problems(tree, reported, self.run_id, self.metrics, self.job, self.scratch / "state")


def reported_by(ledger_file: Path, run_id: str) -> Reported:
    """What the ledger at ``ledger_file`` (a copy: opening it may write) says is committed."""
    events = _events(ledger_file)
    steps = [e["data"].get("step") for e in events if e["run_id"] == run_id and e["kind"] == "checkpoint"]
    return Reported({e["seq"]: e["hash"] for e in events}, max(steps, default=None))


def state_problems(tree: Tree, reported: Reported, run_id: str, metrics: dict[tuple[str, int], dict],
                   job: bytes | None, folder: Path, same=lambda a, b: a == b) -> list[str]:
    """What is wrong with home ``tree`` after a cut, given what the ledger had ``reported``: the
    ledger's audit, reported rows kept, every checkpoint there verifying and the newest recorded one
    among them, metrics.jsonl's lines up to it as in ``metrics`` (compared by ``same``), the job
    file there (and equal to ``job`` unless None)."""
    run = f"runs/{run_id}"
    if folder.exists():
        shutil.rmtree(folder)
    write_tree({k: v for k, v in tree.items() if is_ledger(k) and not_shm(k)}, folder / "home")
    try:
        with Ledger(folder / "home" / LEDGER) as ledger:
            _, chain = ledger.audit()
            records = ledger.audit_records()
            events = ledger.events()
    except (sqlite3.DatabaseError, LedgerError) as exc:
        return [f"the ledger cannot be read: {exc}"]
    found = [f"ledger audit: row {p.seq} {p.problem}" for p in chain]
    found += [f"ledger records: {p}" for p in records]
    have = {e["seq"]: e["hash"] for e in events}
    lost = sorted(seq for seq, digest in reported.events.items() if have.get(seq) != digest)
    if lost:
        found.append(f"ledger rows {lost[:8]}{' ...' if len(lost) > 8 else ''} were reported committed and "
                     f"are gone ({len(lost)} in all)")
    named = max((e["data"].get("step") for e in events if e["run_id"] == run_id and e["kind"] == "checkpoint"),
                default=None)

    ckpts = tree_get(tree, f"{run}/checkpoints")
    store = CheckpointStore(write_tree(ckpts if isinstance(ckpts, dict) else {}, folder / "ckpt"), keep_last=2)
    newest = None
    for step, path in store.committed():
        try:
            store.load(path)
        except CheckpointError as exc:
            found.append(f"checkpoint {path.name} is there but damaged: {exc}")
            continue
        newest = step if newest is None else max(newest, step)
    need = max([s for s in (named, reported.checkpoint) if s is not None], default=None)
    if need is not None and (newest is None or newest < need):
        found.append(f"the ledger recorded checkpoint step {need} (its rows: {named}, reported: "
                     f"{reported.checkpoint}) but the newest that verifies is {newest}")

    if newest is not None:
        lines = metric_records(tree_get(tree, f"{run}/metrics.jsonl"))  # type: ignore[arg-type]
        want = {k: r for k, r in metrics.items() if k[1] <= newest}
        missing = sorted(k for k in want if k not in lines)
        if missing:
            state = "is missing" if tree_get(tree, f"{run}/metrics.jsonl") is None else "lacks them"
            found.append(f"metrics.jsonl {state}: {len(missing)} line(s) at or before checkpoint step {newest}, "
                         f"which resume keeps and never writes again: {missing[:6]}")
        differ = sorted(k for k in want if k in lines and not same(lines[k], want[k]))
        if differ:
            found.append(f"metrics.jsonl lines {differ[:6]} differ from the ones the run wrote")
    written = tree_get(tree, f"{run}/job.toml")
    if any(e["run_id"] == run_id for e in events) and (written is None or (job is not None and written != job)):
        found.append(f"the ledger holds run {run_id} but {run}/job.toml is "
                     f"{'missing' if written is None else 'not what was written'}")
    return found


def numbers(folder: Path) -> dict[tuple[str, int], dict]:
    """Every line of a run's metrics.jsonl by (kind, step), timings left out."""
    return {(r["kind"], r["step"]): exact(r) for r in read_metrics(folder)}


def assert_resumes_to_the_end(home: Path, run_id: str, baseline, where: str) -> None:
    """`lodger resume` in ``home`` finishes with the baseline's final adapter and every logged number,
    and `lodger audit` then finds the ledger intact."""
    env = lodger_env(home)
    resumed = run_lodger(["resume", run_id, "--quiet"], env)
    assert resumed.returncode == 0, f"{where}\n{describe(resumed)}"
    folder = home / "runs" / run_id
    assert final_adapter_bytes(folder) == baseline.adapter, f"{where}: the final adapter differs"
    got, expected = numbers(folder), numbers(baseline.run_dir)
    assert sorted(got) == sorted(expected), f"{where}: metrics.jsonl lacks {sorted(set(expected) - set(got))[:8]}"
    assert got == expected, f"{where}: metric lines differ: {[k for k in sorted(expected) if got[k] != expected[k]][:8]}"
    audit = run_lodger(["audit"], env)
    assert audit.returncode == 0 and "ledger intact" in audit.stdout, f"{where}\n{describe(audit)}"


def _events(path: Path) -> list[dict]:
    with Ledger(path) as ledger:
        return ledger.events()


def _freeze(value) -> object:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, tuple):
        return tuple(_freeze(v) for v in value)
    return value


def paths(tree: Tree, prefix: str = "") -> set[tuple[str, bool]]:
    """Every (path, is a folder) in ``tree``."""
    found: set[tuple[str, bool]] = set()
    for name, value in tree.items():
        found.add((prefix + name, isinstance(value, dict)))
        if isinstance(value, dict):
            found |= paths(value, prefix + name + "/")
    return found


def names_not_durable(disk: Disk, cuts: list[int], ignore=lambda path: False) -> dict[str, str]:
    """Each path whose name (created, renamed or removed) had not been made durable at one of ``cuts``
    (the moments lodger reported something), with the first such cut."""
    found: dict[str, str] = {}
    for cut in cuts:
        live, kept = paths(disk.kill(cut)), paths(disk.state(cut))
        for path, is_dir in sorted(live ^ kept):
            if path in found or ignore(path):
                continue
            how = "made" if (path, is_dir) in live else "removed"
            found[path] = f"{'folder' if is_dir else 'file'} {how} but not durable at {disk.describe_cut(cut)}"
    return found
