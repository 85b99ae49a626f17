"""What leaves with a remote job, whatever the backend: the files copied into storage and the job
that points at the copies (no engine, no torch).

Layout in the run's storage (a folder or a bucket prefix, ``storage.py``)::

    <storage>/<run_id>/data/...         the data files that left (verified against the plan)
    <storage>/<run_id>/model/...        the model folder/file, unless a shared folder already had it
    <storage>/<run_id>/chain_head.json  the owner's ledger head when it left (the event log's anchor)
    <storage>/<run_id>/job.toml         the job as it left, paths relative to this folder; written
                                        LAST and create-only: a job.toml means the staging is whole
    <storage>/<run_id>/events/          the remote side's hash-chained event log (eventlog.py)
    <storage>/<run_id>/heartbeats/      one object per submission: wall time spent (heartbeat.py)
    <storage>/<run_id>/home/runs/<run_id>/  the remote run folder: checkpoints/, metrics.jsonl,
                                        log.txt, adapter/, control/ (pause requests)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .backend import RemoteError

def local_python() -> str:
    import sys

    return sys.executable


def planned_steps(job) -> int:
    """Optimizer steps, counted here without a tokenizer: packed or not, a step holds batch_size x
    grad_accum x world_size examples and ends early at each epoch's end (data/packing.py), so the
    count depends on the number of examples only and equals what the remote run plans."""
    from ..config import total_steps
    from ..data.chats import read_jsonl, split_indices

    if job.training.steps is not None:
        return job.training.steps
    rows = len(read_jsonl(job.data.train).rows)
    if job.data.eval is None:
        rows = len(split_indices(rows, job.data.eval_fraction, job.training.seed)[0])
    return total_steps(job, rows)


def stage(plan, storage, run_id: str, head: dict | None = None):
    """Copy what leaves into ``<storage>/<run_id>/`` (a ``Storage``) and write the job that points
    at the copies, last; return that job and the sha256 of its job.toml."""
    from ..hashing import hash_file
    from ..config.tomlfile import to_toml

    job = plan.job.model_copy(deep=True)
    run = storage.child(run_id)
    if run.exists("job.toml"):
        raise RemoteError(f"{run.uri}/job.toml already exists; a run id is never staged twice")
    expected = {str(Path(f.path).resolve()): f.sha256 for f in plan.files}
    for key in ("train", "eval"):
        source = getattr(job.data, key)
        if source is None:
            continue
        name = f"{key}-{Path(source).name}"
        digest = hash_file(Path(source))
        wanted = expected.get(str(Path(source).resolve()))
        if wanted is not None and digest != wanted:
            raise RemoteError(f"[data] {key} = {str(source)!r} changed since it was approved (sha256 {digest}, "
                              f"approved {wanted}); submit again")
        run.put_file(Path(source), f"data/{name}")
        if run.local and hash_file(Path(run.path(f"data/{name}"))) != digest:
            raise RemoteError(f"[data] {key} = {str(source)!r} changed while it was copied; submit again")
        setattr(job.data, key, Path("data") / name)  # relative: resolved from the job.toml's folder there
    model = Path(job.model.source).expanduser()
    if model.exists() and not (storage.local and model.resolve().is_relative_to(Path(storage.root).resolve())):
        # The cluster cannot see this machine's disk; an alias or a path already in storage it can.
        files = sorted(p for p in model.rglob("*") if p.is_file()) if model.is_dir() else [model]
        for path in files:
            relative = path.relative_to(model).as_posix() if model.is_dir() else ""
            run.put_file(path, "/".join(p for p in ("model", model.name, relative) if p))
        job.model.source = f"model/{model.name}"
    staged = to_toml(job.resolved_dict()).encode()
    if head is not None:  # whoever holds the staged job can check this head against the owner's ledger
        run.write_bytes("chain_head.json", json.dumps(head, sort_keys=True).encode())
    try:
        run.write_bytes("job.toml", staged, exclusive=True)  # the commit of the staging
    except FileExistsError:
        raise RemoteError(f"{run.uri}/job.toml appeared while staging; a run id is never staged twice") from None
    return job, hashlib.sha256(staged).hexdigest()
