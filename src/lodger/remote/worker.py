"""The remote side: what a Ray job runs (``python -m lodger.remote.worker RUN RUN_URI SUBMISSION``).

Two processes. The *worker* (this module's ``main``) prepares a home, starts the *training
process* (the very same lodger training: ``start``), and while it runs pushes its news into the
run's storage (``mirror.py``) and rewrites a heartbeat (``heartbeat.py``); when the training
process ends, however it ends (finished, paused, killed), it pushes once more and exits with its
code. SIGTERM and SIGINT are passed on to the training process (it commits a checkpoint).

On a shared folder the home is ``<storage>/<run_id>/home``, as the owner's machine sees it. On
object storage the home is a scratch folder on the node, filled from the bucket each time: the
staged job, data and model, and, to resume, the newest checkpoint that verifies with the run's
metrics and log. Endpoint and credentials come from the environment (the usual AWS variables
forwarded by the backend); nothing secret is written by the worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRATCH_ENV = "LODGER_WORKER_SCRATCH"  # where a node keeps runs' scratch homes (default: the temp dir)
RUNTIME_MEMOS = ".runtime"  # in the node's folder, beside the scratch homes (run ids never start with a dot)
PUSH_SECONDS = 1.0  # how often news goes out: one small PUT at most, only when something changed
FORWARDED = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION",
             "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def entrypoint(info: dict, run_id: str, submission_id: str) -> list[str]:
    """The command a backend runs for a submission."""
    return [info["python"], "-m", "lodger.remote.worker", run_id, str(info["dir"]), submission_id]


def worker_env(info: dict) -> dict[str, str]:
    """What the job's environment needs beyond the backend's own: on object storage the endpoint,
    profile name, region and this machine's credentials as they are in its environment (never a
    file; nothing of it is written to the ledger or to storage)."""
    from urllib.parse import urlparse

    if urlparse(str(info["dir"])).scheme in ("", "file"):
        return {}
    return {name: os.environ[name] for name in FORWARDED if os.environ.get(name)}


# -- the worker ----------------------------------------------------------------------------------
def main(run_id: str, run_uri: str, submission_id: str) -> int:
    from ..durable import make_dirs
    from ..home import private_temp_dir
    from . import heartbeat
    from .eventlog import EventLog
    from .mirror import Mirror, download_tree
    from .storage import Storage

    store = Storage.open(run_uri)
    node = None
    if store.local:
        root = Path(store.root)
    else:  # the node's own folder first: in /tmp, another user could otherwise have made it, to read or swap it
        node = private_temp_dir(Path(os.environ.get(SCRATCH_ENV) or tempfile.gettempdir()), "lodger-worker",
                                setting=SCRATCH_ENV)
        root = node / run_id
        _fresh(root)
        store.get_file("job.toml", root / "job.toml")
        for prefix in ("data", "model"):
            download_tree(store, prefix, root / prefix)
    home = make_dirs(root / "home")  # owner-only, as a lodger home is; durable: on a shared folder it persists
    if node is not None:
        _copy_runtime_memos(node / RUNTIME_MEMOS, home / "cache" / "runtime")
    anchor = json.loads(store.read_bytes("chain_head.json"))["hash"]
    log = EventLog(store, "events", run_id=run_id, anchor=anchor)
    mirror = Mirror(store, home, run_id, submission_id, log)
    beats = heartbeat.read_all(store)
    segment = max((b for b in _segments(store, beats)), default=None)
    env = {**os.environ, "LODGER_HOME": str(home),
           heartbeat.PRIOR_ENV: repr(sum(v for k, v in beats.items() if k != submission_id))}
    if store.local or segment is None:  # the CLI's worker: crash log in the run, Ray Train for nodes > 1
        command = ["-m", "lodger.cli.main", "_remote_worker", run_id, str(root / "job.toml")]
    else:
        command = ["-m", "lodger.remote.worker", "--train", run_id, str(root / "job.toml"), run_uri, str(segment)]
    child = subprocess.Popen([sys.executable, *command], env=env)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    started, every, last_beat = time.monotonic(), heartbeat.interval(), float("-inf")
    while True:
        try:
            code = child.wait(timeout=PUSH_SECONDS)
        except subprocess.TimeoutExpired:
            code = None
        now = time.monotonic()
        if code is not None or now - last_beat >= every:
            heartbeat.write(store, submission_id, now - started, segment=mirror.state and mirror.state["segment"],
                            ended=code is not None)
            last_beat = now
        try:
            mirror.push()
        except Exception as exc:  # noqa: BLE001 - storage hiccups: the next push carries it all
            print(f"lodger worker: push to {store.uri} failed ({exc}); retrying", file=sys.stderr, flush=True)
            if code is not None:
                raise
        if code is not None:
            heartbeat.write(store, submission_id, time.monotonic() - started,
                            segment=mirror.state and mirror.state["segment"], ended=True)
            if node is not None:  # everything is in the bucket; the node keeps no copy of the data
                from .. import durable

                _copy_runtime_memos(home / "cache" / "runtime", node / RUNTIME_MEMOS)
                durable.remove_tree(root)
            return code if code >= 0 else 128 - code


def _segments(store, beats: dict) -> list[int]:
    """The segments earlier submissions reached (their heartbeats say), for a resume on a fresh home."""
    from .heartbeat import PREFIX

    found = []
    for name in beats:
        try:
            segment = json.loads(store.read_bytes(f"{PREFIX}/{name}.json")).get("segment")
        except (OSError, ValueError):
            continue
        if type(segment) is int and segment >= 0:
            found.append(segment)
    return found


def _copy_runtime_memos(source: Path, dest: Path) -> None:
    """The training runtime's measured size (memory/measure.py's memos, by library versions and
    threads) from one folder to another, each memo missing there: a scratch home is new for every
    submission, and measuring it again costs an interpreter importing torch before training starts.
    What they hold belongs to the node, not to a run, so the node keeps them."""
    from .. import durable

    if not source.is_dir():
        return
    durable.make_dirs(dest)
    for memo in source.glob("*.json"):
        if not (dest / memo.name).exists():
            durable.atomic_write(dest / memo.name, memo.read_bytes())


def _fresh(root: Path) -> None:
    from .. import durable

    if root.exists():
        durable.remove_tree(root)
    # Scratch on a node that keeps nothing (the bucket holds the record): no name here needs to outlast a cut.
    root.mkdir(parents=True, mode=0o700)


# -- the training process ------------------------------------------------------------------------
def start(run_id: str, job_path: Path) -> str:
    """Train in this home: the first start creates the run under the local run's id, every later
    start (on a shared folder, where the home persists) resumes it from its newest good checkpoint."""
    from .. import durable
    from ..home import run_dir
    from ..ledger import Ledger
    from ..lifecycle.run import Run

    with Ledger() as ledger:
        exists = ledger.has_run(run_id)
    if exists:
        again = Run(run_id)
        again.reopen()
        return again.start(resuming=True, quiet=True).status
    if run_dir(run_id).exists():  # a first start that died between its folder and its ledger row
        durable.remove_tree(run_dir(run_id))
    return Run.create(job_path, run_id=run_id, managed=True).start(resuming=False, quiet=True).status


def resume_fresh(run_id: str, job_path: Path, run_uri: str, segment: int) -> str:
    """Resume on a fresh home: create the run, put the newest verifying checkpoint (and the
    metrics and log) from storage into it, and resume as a new segment after ``segment``."""
    from ..home import run_dir
    from ..ledger import Ledger
    from ..lifecycle.run import Run
    from .mirror import seed
    from .storage import Storage

    new = Run.create(job_path, run_id=run_id, managed=True)
    seed(Storage.open(run_uri), new.run_id, run_dir(new.run_id))
    with Ledger() as ledger:
        ledger.update_run(new.run_id, segment=segment)
    return new.start(resuming=True, quiet=True).status


def _train(run_id: str, job_path: str, run_uri: str, segment: str) -> int:
    resume_fresh(run_id, Path(job_path), run_uri, int(segment))
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--train"]:
        sys.exit(_train(*args[1:5]))
    from ..errors import LodgerError

    try:
        sys.exit(main(*args[:3]))
    except LodgerError as exc:  # e.g. a node folder another user could control: `lodger logs RUN --ray` says it
        print(f"lodger worker: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
