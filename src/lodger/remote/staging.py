"""What leaves with a remote job, whatever the backend: the files copied into storage and the job
that points at the copies (no engine, no torch).

Layout in storage::

    <storage>/<run_id>/job.toml         the job as it left, paths pointing at the copies below
    <storage>/<run_id>/chain_head.json  the owner's ledger head when it left
    <storage>/<run_id>/data/...         the data files that left (verified against the plan)
    <storage>/<run_id>/model/           the model folder/file, unless storage already had it
    <storage>/<run_id>/home/            the remote LODGER_HOME: ledger.db, runs/<run_id>/
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from .. import durable
from .backend import RemoteError


def local_python() -> str:
    import sys

    return sys.executable


def planned_steps(job) -> int:
    """Optimizer steps, counted here without a tokenizer (the remote side records the exact figure)."""
    from ..config import total_steps
    from ..data import read_jsonl, split_indices

    if job.training.steps is not None:
        return job.training.steps
    rows = len(read_jsonl(job.data.train).rows)
    if job.data.eval is None:
        rows = len(split_indices(rows, job.data.eval_fraction, job.training.seed)[0])
    return total_steps(job, rows)


def stage(plan, storage: Path, run_id: str, head: dict | None = None):
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
