"""What the page shows, as plain JSON-able dicts: the runs table, one run, the machine, a comparison.

Read from the ledger and the run folders the way `lodger ls`, `show`, `status` and `compare` read
them (the same library functions), never from a copy: the page and the terminal cannot disagree.
Nothing here imports torch; the table reads each run's metrics from the end of its file only, so
it answers in milliseconds however long the runs are.
"""

from __future__ import annotations

import json
import os
import threading
import time
import tomllib
from pathlib import Path

from ..checkpoint import CheckpointStore
from ..errors import CheckpointError
from ..home import run_dir
from ..ledger import Ledger
from ..lifecycle.runview import TAIL_BYTES, live_status, progress

TIMELINE_HIDDEN = ("metrics",)  # one per checkpoint's metric rows: the curves show them
_verified: dict[str, tuple[int, bool, str | None]] = {}  # checkpoint folder -> (manifest mtime, ok, problem)
_jobs: dict[str, dict] = {}  # job text -> parsed
_verifying: set[str] = set()
_verifying_lock = threading.Lock()
_executor = None
verified_count = 0


def job_of(run: dict) -> dict:
    text = run.get("job_toml") or ""
    if text not in _jobs:
        try:
            _jobs[text] = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            _jobs[text] = {}
    return _jobs[text]


def checkpoint_state(folder: Path) -> dict | None:
    """The newest committed checkpoint and whether its files match its manifest: None while it is
    being checked. Each is hashed once per manifest, by one background thread, so that a first
    page of a hundred runs does not wait on hashing their checkpoints."""
    root = folder / "checkpoints"
    if not root.is_dir():
        return None
    committed = CheckpointStore(root).committed()  # an existing folder: nothing is written
    if not committed:
        return None
    step, path = committed[0]
    try:
        stamp = (path / "MANIFEST.json").stat().st_mtime_ns
    except OSError:
        stamp = -1
    cached = _verified.get(str(path))
    if cached is None or cached[0] != stamp:
        with _verifying_lock:
            if str(path) not in _verifying:
                _verifying.add(str(path))
                _verifier().submit(_verify, root, path, stamp)
        return {"step": step, "name": path.name, "verified": None, "problem": None}
    return {"step": step, "name": path.name, "verified": cached[1], "problem": cached[2]}


def _verifier():
    global _executor
    if _executor is None:
        from concurrent.futures import ThreadPoolExecutor

        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lodger-ui-verify")
    return _executor


def _verify(root: Path, path: Path, stamp: int) -> None:
    global verified_count
    try:
        CheckpointStore(root).load(path)
        result: tuple[int, bool, str | None] = (stamp, True, None)
    except CheckpointError as exc:
        result = (stamp, False, str(exc))
    except OSError as exc:  # pruned meanwhile: looked at again next time
        result = (stamp, False, f"unreadable: {exc}")
    _verified[str(path)] = result
    with _verifying_lock:
        _verifying.discard(str(path))
        verified_count += 1  # the event stream sends the table again when this moves


def recent_steps(folder: Path, count: int = 20) -> list[dict]:
    """The newest train records of a run's metrics.jsonl, read from its end only."""
    try:
        with open(folder / "metrics.jsonl", "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - TAIL_BYTES))
            lines = fh.read().split(b"\n")[1 if size > TAIL_BYTES else 0:]
    except OSError:
        return []
    found = []
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind") == "train":
            found.append(record)
            if len(found) >= count:
                break
    return found[::-1]


def eta_seconds(info: dict, recent: list[dict]) -> float | None:
    """Time left at the recent steps' pace (held time is not in a step's seconds)."""
    times = [r["seconds"] for r in recent if isinstance(r.get("seconds"), (int, float))]
    left = (info.get("total_steps") or 0) - info["step"]
    if not times or left <= 0:
        return None
    return left * sum(times) / len(times)


def held_seconds(ledger: Ledger) -> dict[str, float]:
    """Each run's time spent held: its finished holds, and the one going on now."""
    held: dict[str, float] = {}
    since: dict[str, float] = {}
    for e in ledger.events_of_kinds(("held", "continued")):
        run = e["run_id"]
        if e["kind"] == "held":
            since[run] = e["time"]
        else:
            held[run] = held.get(run, 0.0) + float(e["data"].get("held_seconds") or 0.0)
            since.pop(run, None)
    for run, start in since.items():
        held[run] = held.get(run, 0.0) + max(0.0, time.time() - start)
    return held


def run_row(run: dict, held: dict[str, float]) -> dict:
    folder = run_dir(run["id"])
    local = not run.get("target")
    info = progress(run, folder if local else None)
    recent = recent_steps(folder) if local else []
    method = job_of(run).get("method", {})
    status = live_status(run)
    return {"id": run["id"], "status": status, "model": Path(run["model"] or "").name or run["model"],
            "method": run["method"], "objective": method.get("objective", "sft"), "step": info["step"],
            "total_steps": run["total_steps"], "checkpoint_step": info["checkpoint_step"], "loss": info["loss"],
            "eval_loss": info["eval_loss"], "eta_seconds": eta_seconds(info, recent) if status == "running" else None,
            "held_seconds": round(held.get(run["id"], 0.0), 1), "created": run["created"], "target": run.get("target"),
            "checkpoint": checkpoint_state(folder) if local else None}


def runs_table(ledger: Ledger) -> dict:
    """Every run of the home (newest first), the queue and the agent: the page's main table."""
    from ..owner.agent import agent_pid

    held = held_seconds(ledger)
    runs = sorted(ledger.runs(), key=lambda r: r["created"] or 0, reverse=True)
    return {"runs": [run_row(r, held) for r in runs],
            "queue": [{k: e[k] for k in ("id", "name", "priority", "added")} for e in ledger.queue()],
            "agent_pid": agent_pid(), "head": ledger.head()["seq"], "time": time.time()}


def run_detail(ledger: Ledger, run_id: str, against: Path | None = None) -> dict:
    """One run as `lodger show` sees it: events (each marked verified or not), provenance, the
    chain's problems with its rows, its checkpoints and its job."""
    from ..ledger.witness import unconfirmed

    run = ledger.find_run(run_id)
    events = ledger.events(run["id"])
    problems = [f"{p.where()}: {p.problem}" for p in ledger.run_problems([run["id"]])]
    through, witness = unconfirmed(ledger, against, events) if against else (None, [])
    problems += witness
    shown = []
    for e in events:
        if e["kind"] in TIMELINE_HIDDEN:
            continue
        data = {k: v for k, v in e["data"].items() if k not in ("compute", "memory_estimate", "measured")}
        shown.append({"seq": e["seq"], "time": e["time"], "kind": e["kind"], "data": data,
                      "verified": through is None or e["seq"] <= through})
    folder = run_dir(run["id"])
    checkpoints = sorted(p.name for p in (folder / "checkpoints").glob("step-*")) if folder.is_dir() else []
    held = held_seconds(ledger)
    return {"run": run_row(run, held), "events": shown, "provenance": ledger.provenance(run["id"]),
            "audit": {"problems": problems, "against": str(against) if against else None,
                      "verified": not problems}, "checkpoints": checkpoints, "job": run["job_toml"]}


def compare_view(ids: list[str]) -> dict:
    """Each run against the first, with `lodger compare`'s verdict and where the losses part."""
    from ..reporting.compare import compare_runs, loss_difference_text

    if len(ids) < 2:
        return {"pairs": []}
    pairs = []
    for other in ids[1:]:
        c = compare_runs(ids[0], other)
        parted = next((s for s, la, lb in c.losses if la is not None and lb is not None and la != lb), None)
        pairs.append({"a": c.a, "b": c.b, "verdict": c.verdict, "equal": c.equal, "first_difference": parted,
                      "losses": loss_difference_text(c), "weights_equal": c.weights_equal,
                      "job_differences": {k: [str(v[0]), str(v[1])] for k, v in c.job_differences.items()}})
    return {"pairs": pairs}
