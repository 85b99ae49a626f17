"""Remote execution: submit an approved job to a target's backend, pause, resume, cancel it.

The remote side runs the very same lodger training (``remote/worker.py``, i.e. `execute`) in its
own LODGER_HOME, with the same run id as the local run: ``<storage>/<run_id>/home`` on a shared
folder, a scratch folder on the node for object storage (``s3://``), mirrored into the same keys
of the bucket. Checkpoints, exact resume and limits are therefore the local ones. The local run
is a mirror: ``sync.py`` copies committed checkpoints, metrics and the event log back from
storage (``storage.py``, by URI), never a remote database.

This module is backend-neutral: it stages what leaves (``staging.py``), keeps the ledger, and
drives the run's backend (``backend.py``: the interface and the kinds; ``ray.py``: Ray) through
``submit``, ``status``, ``logs``, ``cancel``, ``pause`` and ``resume``. Importing it is cheap:
an engine's library is imported only when that engine is asked something (status, ls, show and
pause must stay light).

Beside it: ``gate.py`` (what `lodger submit` checks before anything leaves the machine),
``targets.py`` (named targets and the owner's caps) and ``executors.py`` (where a run lives, here
or on a target, as one seam the commands use). The package sits above the run's life, which the
worker starts; ``targets.py`` and ``backend.py`` import only the floor and sit low in the drawing.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from .. import durable
from ..errors import RunStateError
from .backend import TERMINAL, Backend, RemoteError, get_backend
from .place import (is_remote, on_shared_folder, remote_home, remote_info, remote_run_dir,  # noqa: F401
                    run_key, run_storage)

__all__ = ["TERMINAL", "RemoteError", "backend_for", "cancel", "is_remote", "job_logs", "job_status",
           "pause", "answered_state", "remote_home", "remote_info", "remote_run_dir", "resume", "run_key", "run_storage",
           "submit"]


def backend_for(run: dict) -> Backend:
    """The backend the run was submitted to (runs submitted before kinds were recorded: Ray)."""
    return get_backend(remote_info(run).get("kind", "ray"))


# -- asking the backend -----------------------------------------------------------------------
def job_status(run: dict) -> tuple[str | None, str | None]:
    """(status, message) of the run's current submission; (None, why) if the backend cannot say."""
    return backend_for(run).status(run)


def job_logs(run: dict) -> str:
    """The backend's own log of the run's current submission (the entrypoint's stdout and stderr)."""
    return backend_for(run).logs(run)


# -- submit -----------------------------------------------------------------------------------
def submit(plan) -> str:
    """Send an approved job (a gate Plan) to its target's backend; return the local run id.

    Nothing is written before the backend answers. Then the files that leave are copied into
    ``<storage>/<run_id>/`` (verified against the plan's sha256; job.toml last, create-only: it
    is the staging's commit), the local run is recorded with its target, and the job is submitted.
    A refused submission leaves the run recorded as failed, with the reason.
    """
    from ..config.tomlfile import to_toml
    from ..home import run_dir
    from ..ledger import Ledger
    from ..lifecycle.prepare import JOB_FILE
    from ..lifecycle.run import new_run_id, new_run_record
    from .staging import local_python, planned_steps, stage

    from .storage import Storage, StorageError

    job, target = plan.job, plan.target
    try:
        storage = Storage.open(target.storage)
    except StorageError as exc:
        raise RemoteError(f"target {plan.target_name}: {exc}") from None
    if storage.local and not Path(storage.root).is_dir():
        raise RemoteError(f"target {plan.target_name}: storage = {target.storage!r} is not a folder here; create it "
                          "or point the target at the folder this machine and the cluster share, or at a bucket "
                          "(s3://bucket/prefix)")
    backend = get_backend(target.kind)
    backend.connect(target.address)  # fail before writing anything when the cluster is not there
    if job.training.threads is None:
        raise RemoteError("[training] threads: set it explicitly for a remote job (exactness depends on it)")
    name = job.name or Path(plan.job_path).stem
    run_id = new_run_id(name)
    with Ledger() as ledger:
        head = ledger.head()  # the chain as it was when this left: staged with it and recorded below
    remote_job, job_sha256 = stage(plan, storage, run_id, head)
    # `lodger sync` and `lodger resume` refuse a job.toml in storage that no longer has this hash.
    # Only the URI goes into the ledger: endpoint and keys stay in the environment (storage.py).
    run_uri = storage.child(run_id).uri if not storage.local else str(Path(storage.root) / run_id)
    info = {"kind": backend.kind, "address": target.address, "storage": target.storage, "dir": run_uri,
            "python": target.python or local_python(), "cost_per_gpu_hour": target.cost_per_gpu_hour,
            "job_sha256": job_sha256, "anchor": head["hash"]}

    durable.write_folder(run_dir(run_id), {JOB_FILE: to_toml(job.resolved_dict()).encode()})
    submission_id = f"{run_id}-s0"
    leaving = [{"role": f.role, "path": str(f.path), "size": f.size, "sha256": f.sha256} for f in plan.files]
    with Ledger() as ledger:
        with ledger.transaction():
            ledger.create_run(new_run_record(run_id, job, name, planned_steps(job), managed=True))
            ledger.update_run(run_id, target=plan.target_name, remote=json.dumps(info), remote_job_id=submission_id)
        try:
            backend.submit(info, run_id, submission_id, remote_job)
        except RemoteError as exc:
            ledger.set_status(run_id, "failed", error=str(exc))
            raise
        ledger.set_status(run_id, "submitted", "remote_submitted", target=plan.target_name,
                          address=target.address, submission_id=submission_id, storage=info["dir"],
                          job_sha256=job_sha256, files=leaving, estimate=plan.estimate, cost=plan.cost,
                          datasets=plan.datasets, chain_head=head)
    return run_id


# -- pause, resume and cancel -----------------------------------------------------------------
def pause(ledger, run: dict, mode: str) -> Path:
    """Ask a remote run to release (checkpoint and exit) or hold; return the folder where it answers.

    On object storage the request is an object the worker polls (``<run>/home/runs/<run>/control/``)."""
    if run["status"] not in ("submitted", "running", "held"):
        raise RunStateError(f"run {run['id']} is not training now (status {run['status']})")
    folder = remote_run_dir(run)
    if on_shared_folder(run):
        backend_for(run).pause(ledger, run, mode, folder)
        return folder
    import time

    body = {"state": mode, "by": "user", "reason": "lodger pause", "time": time.time()}  # as control.write_request
    run_storage(run).write_bytes(f"{run_key(run['id'])}/control/user.json", json.dumps(body).encode())
    ledger.event(run["id"], "pause_requested", mode=mode, by="user", target=run["target"])
    return folder


def answered_state(run: dict, folder: Path, every: float = 1.0) -> dict:
    """What the remote run last said about itself (``control/state.json``), for a command waiting
    on its answer: read in the shared folder, or, on object storage, synced home at most every
    ``every`` seconds (one sync is a few small requests)."""
    import time

    from ..owner.control import run_state

    if not on_shared_folder(run):
        last = _synced_at.get(run["id"], 0.0)
        if time.monotonic() - last >= every:
            from ..ledger import Ledger
            from .sync import sync

            with Ledger() as ledger:
                sync(ledger, ledger.run(run["id"]))
            _synced_at[run["id"]] = time.monotonic()
    return run_state(folder)


_synced_at: dict[str, float] = {}


def _clear_requests(run: dict) -> None:
    """Void the owner's and the agent's pause requests (a live run notices and continues)."""
    if on_shared_folder(run):
        backend_for(run).resume(run, remote_run_dir(run))
        return
    store = run_storage(run)
    for requester in ("user", "agent"):
        store.delete(f"{run_key(run['id'])}/control/{requester}.json")


def resume(ledger, run: dict) -> str:
    """Continue a remote run: a live one by clearing its pause requests, a stopped one by a new
    submission that resumes from the newest good checkpoint in storage. Returns what happened."""
    from ..config import JobConfig
    from ..lifecycle.jobfile import load_job
    from .sync import staged_job, sync

    run = sync(ledger, run)  # refuses a job.toml changed in storage since submission
    if run["status"] == "finished":
        raise RunStateError(f"run {run['id']} already finished; start a new one with `lodger submit`")
    if run["status"] == "cancelled":
        raise RunStateError(f"run {run['id']} was cancelled; submit the job again for a new run")
    backend = backend_for(run)
    status, _ = backend.status(run)
    if status in ("PENDING", "RUNNING") and run["status"] in ("paused", "interrupted"):
        status = _wait_for_job_end(backend, run)  # the run said it stopped; the engine sees its process exit later
    _clear_requests(run)
    if status in ("PENDING", "RUNNING"):
        ledger.event(run["id"], "resume_requested", by="user")
        return "continues"  # the remote process notices the cleared request by polling
    info = remote_info(run)
    from .heartbeat import refuse_past_wall_limit

    staged = staged_job(run)  # checked again, and parsed from the very bytes checked
    # Its training and [remote] tables only: its data paths name copies in storage, not files here.
    job = JobConfig.model_validate(tomllib.loads(staged.decode())) if staged is not None else None
    if job is not None:
        refuse_past_wall_limit(run_storage(run), run["id"], job.remote.wall_hours)
    submissions = sum(1 for e in ledger.events(run["id"]) if e["kind"] == "remote_submitted")
    submission_id = f"{run['id']}-s{submissions}"
    if job is None:
        job = load_job(Path(info["dir"]) / "job.toml")
    backend.submit(info, run["id"], submission_id, job)
    with ledger.transaction():
        ledger.update_run(run["id"], remote_job_id=submission_id)
        ledger.set_status(run["id"], "submitted", "remote_submitted", target=run["target"],
                          address=info["address"], submission_id=submission_id, resume=True)
    return f"resubmitted as {submission_id}"


def _wait_for_job_end(backend: Backend, run: dict, timeout: float = 60.0) -> str:
    """The backend's status of a job whose run has said it stopped, once it has seen the process exit.

    Resuming while it still says RUNNING would only clear requests of a process on its way out."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        status, _ = backend.status(run)
        if status not in ("PENDING", "RUNNING"):
            return status
        if time.monotonic() > deadline:
            raise RemoteError(f"run {run['id']} says it {run['status']}, but after {timeout:.0f} s {backend.title} "
                              f"still reports its job {run['remote_job_id']} {status}; try `lodger resume "
                              f"{run['id']}` again in a moment, or `lodger sync` to see what {backend.title} says")
        time.sleep(0.2)  # a poll inside a bounded wait


def cancel(ledger, run: dict) -> bool:
    """Stop the run's job there (SIGTERM: it commits a checkpoint if it can) and mark it cancelled.

    Returns whether a job was still running there."""
    remote_info(run)  # a local run: refused before anything else
    if run["status"] in ("finished", "cancelled"):
        raise RunStateError(f"run {run['id']} is already {run['status']}")
    was_running = backend_for(run).cancel(run)
    ledger.set_status(run["id"], "cancelled", "cancelled", by="user", submission_id=run["remote_job_id"],
                      was_running=was_running)
    return was_running
