"""Remote execution on a Ray cluster: submit an approved job, resubmit it to resume, cancel it.

The remote side runs the very same lodger training (`lodger _remote_worker`, i.e. `execute`) in
its own LODGER_HOME under the target's storage folder, ``<storage>/<run_id>/home``, with the
same run id as the local run. Checkpoints, exact resume and limits are therefore the local
ones. The local run is a mirror: `sync.py` copies committed checkpoints, metrics and events
back from storage (no ray needed), and this module talks to Ray's job submission API.

Layout in storage::

    <storage>/<run_id>/job.toml         the job as it left, paths pointing at the copies below
    <storage>/<run_id>/data/...         the data files that left (verified against the plan)
    <storage>/<run_id>/model/           the model folder/file, unless storage already had it
    <storage>/<run_id>/home/            the remote LODGER_HOME: ledger.db, runs/<run_id>/

Ray is imported only inside the functions that submit, stop or ask Ray; importing this module
is cheap (status, ls, show and pause must stay light).
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import tomllib
from pathlib import Path

from .. import durable
from ..errors import LodgerError, RunStateError

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class RemoteError(LodgerError):
    """The remote target cannot be reached, refused the job, or its storage is unusable."""

    exit_code = 4





# -- where things are -------------------------------------------------------------------------
def is_remote(run: dict) -> bool:
    return bool(run.get("target"))


def remote_info(run: dict) -> dict:
    """What the run was submitted with: address, storage dir, python, price (recorded at submit)."""
    if not is_remote(run):
        raise RunStateError(f"run {run['id']} runs on this machine, not on a remote target")
    return json.loads(run["remote"])


def remote_home(run: dict) -> Path:
    return Path(remote_info(run)["dir"]) / "home"


def remote_run_dir(run: dict) -> Path:
    """The remote run folder (checkpoints, metrics.jsonl, log.txt, control/), as seen from here."""
    return remote_home(run) / "runs" / run["id"]


# -- talking to Ray ---------------------------------------------------------------------------
def _client(address: str):
    from ray.job_submission import JobSubmissionClient  # heavy: only where Ray is really needed

    try:
        return JobSubmissionClient(address)
    except Exception as exc:  # ConnectionError, RuntimeError, auth errors: all mean "cannot use it"
        raise RemoteError(f"cannot reach the Ray cluster at {address}: {exc}; is it running (`ray status`), "
                          "and is the target's address its dashboard URL?") from None


def job_status(run: dict) -> tuple[str | None, str | None]:
    """(Ray's status, its message) of the run's current submission; (None, why) if Ray cannot say."""
    info = remote_info(run)
    if not run.get("remote_job_id"):
        return None, "never submitted"
    client = _client(info["address"])
    try:
        job = client.get_job_info(run["remote_job_id"])
    except Exception as exc:
        return None, str(exc)
    return str(job.status.value if hasattr(job.status, "value") else job.status), job.message


def job_logs(run: dict) -> str:
    """Ray's own log of the run's current submission (the entrypoint's stdout and stderr)."""
    client = _client(remote_info(run)["address"])
    try:
        return client.get_job_logs(run["remote_job_id"])
    except Exception as exc:
        raise RemoteError(f"Ray has no logs for submission {run['remote_job_id']}: {exc}") from None


def _submit_job(info: dict, run_id: str, submission_id: str, job) -> None:
    """Start `lodger _remote_worker` on the cluster: first start and every resume alike."""
    from ..train.limits import COST_ENV, REMOTE_ENV

    client = _client(info["address"])
    entrypoint = " ".join(shlex.quote(part) for part in (
        info["python"], "-m", "lodger.cli.main", "_remote_worker", run_id, str(Path(info["dir"]) / "job.toml")))
    env = {"LODGER_HOME": str(Path(info["dir"]) / "home"), REMOTE_ENV: "1",
           COST_ENV: repr(float(info["cost_per_gpu_hour"])),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # With world_size > 1 the worker runs torchrun itself (one node): it needs every rank's share.
    world = job.training.world_size
    gpus = world if job.training.device == "cuda" else 0
    try:
        client.submit_job(entrypoint=entrypoint, submission_id=submission_id, runtime_env={"env_vars": env},
                          entrypoint_num_cpus=(job.training.threads or 1) * world, entrypoint_num_gpus=gpus or None,
                          metadata={"lodger_run": run_id})
    except Exception as exc:
        raise RemoteError(f"the Ray cluster at {info['address']} refused submission {submission_id}: {exc}") from None


# -- submit -----------------------------------------------------------------------------------
def submit(plan) -> str:
    """Send an approved job (a gate Plan) to its Ray target; return the local run id.

    Nothing is written before the cluster answers. Then the files that leave are copied into
    ``<storage>/<run_id>/`` (staged in a temporary folder, verified against the plan's sha256,
    renamed into place), the local run is recorded with its target, and the Ray job is
    submitted. A refused submission leaves the run recorded as failed, with the reason.
    """
    from ..config import to_toml
    from ..home import run_dir
    from ..ledger import Ledger
    from ..config import job_hash
    from ..run import JOB_FILE, new_run_id

    job, target = plan.job, plan.target
    storage = Path(target.storage).expanduser()
    if not storage.is_dir():
        raise RemoteError(f"target {plan.target_name}: storage = {str(storage)!r} is not a folder here; create it "
                          "or point the target at the folder this machine and the cluster share")
    _client(target.address)  # fail before writing anything when the cluster is not there
    if job.training.threads is None:
        raise RemoteError("[training] threads: set it explicitly for a remote job (exactness depends on it)")
    name = job.name or Path(plan.job_path).stem
    run_id = new_run_id(name)
    with Ledger() as ledger:
        head = ledger.head()  # the chain as it was when this left: staged with it and recorded below
    remote_job, job_sha256 = _stage(plan, storage, run_id, head)
    # `lodger sync` and `lodger resume` refuse a job.toml in storage that no longer has this hash.
    info = {"address": target.address, "storage": str(storage), "dir": str(storage / run_id),
            "python": target.python or _local_python(), "cost_per_gpu_hour": target.cost_per_gpu_hour,
            "job_sha256": job_sha256}

    durable.write_folder(run_dir(run_id), {JOB_FILE: to_toml(job.resolved_dict()).encode()})
    submission_id = f"{run_id}-s0"
    leaving = [{"role": f.role, "path": str(f.path), "size": f.size, "sha256": f.sha256} for f in plan.files]
    with Ledger() as ledger:
        with ledger.transaction():
            ledger.create_run(run_id, name=name, model=job.model.source, method=job.method.kind,
                              job_hash=job_hash(job), job_toml=to_toml(job.resolved_dict()),
                              total_steps=_total_steps(job), pid=None, managed=True)
            ledger.update_run(run_id, target=plan.target_name, remote=json.dumps(info), remote_job_id=submission_id)
        try:
            _submit_job(info, run_id, submission_id, remote_job)
        except RemoteError as exc:
            ledger.set_status(run_id, "failed", error=str(exc))
            raise
        ledger.set_status(run_id, "submitted", "remote_submitted", target=plan.target_name,
                          address=target.address, submission_id=submission_id, storage=info["dir"],
                          job_sha256=job_sha256, files=leaving, estimate=plan.estimate, cost=plan.cost,
                          datasets=plan.datasets, chain_head=head)
    return run_id


def _local_python() -> str:
    import sys

    return sys.executable


def _total_steps(job) -> int:
    """Optimizer steps, counted here without a tokenizer (the remote side records the exact figure)."""
    from ..config import total_steps
    from ..data import read_jsonl, split_indices

    if job.training.steps is not None:
        return job.training.steps
    rows = len(read_jsonl(job.data.train).rows)
    if job.data.eval is None:
        rows = len(split_indices(rows, job.data.eval_fraction, job.training.seed)[0])
    return total_steps(job, rows)


def _stage(plan, storage: Path, run_id: str, head: dict | None = None):
    """Copy what leaves into ``<storage>/<run_id>/`` and write the job that points at the copies;
    return that job and the sha256 of its job.toml."""
    from ..checkpoint import hash_file
    from ..config import to_toml

    job = plan.job.model_copy(deep=True)
    tmp = storage / f".tmp-{run_id}"
    final = storage / run_id
    durable.mkdir(tmp)
    try:
        (tmp / "data").mkdir()
        expected = {str(Path(f.path).resolve()): f.sha256 for f in plan.files}
        for key in ("train", "eval"):
            source = getattr(job.data, key)
            if source is None:
                continue
            copy = tmp / "data" / (f"{key}-{Path(source).name}")
            shutil.copyfile(source, copy)
            digest = hash_file(copy)
            wanted = expected.get(str(Path(source).resolve()))
            if wanted is not None and digest != wanted:
                raise RemoteError(f"[data] {key} = {str(source)!r} changed since it was approved (sha256 {digest}, "
                                  f"approved {wanted}); submit again")
            setattr(job.data, key, final / "data" / copy.name)
        model = Path(job.model.source).expanduser()
        if model.exists() and not model.resolve().is_relative_to(storage.resolve()):
            # The cluster cannot see this machine's disk; an alias or a path already in storage it can.
            copy = tmp / "model" / model.name
            (tmp / "model").mkdir()
            if model.is_dir():
                shutil.copytree(model, copy)
            else:
                shutil.copyfile(model, copy)
            job.model.source = str(final / "model" / model.name)
        staged = to_toml(job.resolved_dict()).encode()
        durable.write_file(tmp / "job.toml", staged)
        if head is not None:  # whoever holds the staged job can check this head against the owner's ledger
            durable.write_file(tmp / "chain_head.json", json.dumps(head, sort_keys=True).encode())
        durable.fsync_dir(tmp)
        durable.rename(tmp, final)
        durable.fsync_dir(storage)
    except BaseException:
        durable.remove_tree(tmp)
        raise
    return job, hashlib.sha256(staged).hexdigest()


# -- resume and cancel ------------------------------------------------------------------------
def resume(ledger, run: dict) -> str:
    """Continue a remote run: a live one by clearing its pause requests, a stopped one by a new
    Ray submission that resumes from the newest good checkpoint in storage. Returns what happened."""
    from ..config import load_job, parse_job
    from ..control import clear_request
    from .sync import staged_job, sync

    run = sync(ledger, run)  # refuses a job.toml changed in storage since submission
    if run["status"] == "finished":
        raise RunStateError(f"run {run['id']} already finished; start a new one with `lodger submit`")
    if run["status"] == "cancelled":
        raise RunStateError(f"run {run['id']} was cancelled; submit the job again for a new run")
    folder = remote_run_dir(run)
    status, _ = job_status(run)
    if status in ("PENDING", "RUNNING") and run["status"] in ("paused", "interrupted"):
        status = _wait_for_job_end(run)  # the run said it stopped; Ray sees its process exit a moment later
    for requester in ("user", "agent"):  # the owner asked for it: earlier pause requests are void
        clear_request(folder, requester)
    if status in ("PENDING", "RUNNING"):
        ledger.event(run["id"], "resume_requested", by="user")
        return "continues"  # the remote process notices the cleared request by polling
    info = remote_info(run)
    submissions = sum(1 for e in ledger.events(run["id"]) if e["kind"] == "remote_submitted")
    submission_id = f"{run['id']}-s{submissions}"
    path = Path(info["dir"]) / "job.toml"
    staged = staged_job(run)  # checked again, and parsed from the very bytes checked
    job = load_job(path) if staged is None else parse_job(tomllib.loads(staged.decode()), str(path), path.parent)
    _submit_job(info, run["id"], submission_id, job)
    with ledger.transaction():
        ledger.update_run(run["id"], remote_job_id=submission_id)
        ledger.set_status(run["id"], "submitted", "remote_submitted", target=run["target"],
                          address=info["address"], submission_id=submission_id, resume=True)
    return f"resubmitted as {submission_id}"


def _wait_for_job_end(run: dict, timeout: float = 60.0) -> str:
    """Ray's status of a job whose run has said it stopped, once Ray has seen the process exit.

    Resuming while Ray still says RUNNING would only clear requests of a process on its way out."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        status, _ = job_status(run)
        if status not in ("PENDING", "RUNNING"):
            return status
        if time.monotonic() > deadline:
            raise RemoteError(f"run {run['id']} says it {run['status']}, but after {timeout:.0f} s Ray still "
                              f"reports its job {run['remote_job_id']} {status}; try `lodger resume {run['id']}` "
                              "again in a moment, or `lodger sync` to see what Ray says")
        time.sleep(0.2)  # a poll inside a bounded wait


def cancel(ledger, run: dict) -> bool:
    """Stop the run's Ray job (SIGTERM: it commits a checkpoint if it can) and mark it cancelled.

    Returns whether a job was still running there."""
    info = remote_info(run)
    if run["status"] in ("finished", "cancelled"):
        raise RunStateError(f"run {run['id']} is already {run['status']}")
    client = _client(info["address"])
    try:
        was_running = bool(client.stop_job(run["remote_job_id"]))
    except Exception as exc:
        raise RemoteError(f"Ray could not stop submission {run['remote_job_id']}: {exc}") from None
    ledger.set_status(run["id"], "cancelled", "cancelled", by="user", submission_id=run["remote_job_id"],
                      was_running=was_running)
    return was_running
