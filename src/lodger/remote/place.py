"""Where a remote run's things are: its key under the storage, what it was submitted with, its
storage, and its run folder as this machine sees it. A leaf of remote/: the package, the backends
and sync all read it, and it reads none of them."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import RunStateError


def run_key(run_id: str) -> str:
    """The key of the remote run folder under the run's storage (the same on a folder and a bucket)."""
    return f"home/runs/{run_id}"



def is_remote(run: dict) -> bool:
    return bool(run.get("target"))


def remote_info(run: dict) -> dict:
    """What the run was submitted with: kind, address, storage dir, python, price (recorded at submit)."""
    if not is_remote(run):
        raise RunStateError(f"run {run['id']} runs on this machine, not on a remote target")
    return json.loads(run["remote"])


def run_storage(run: dict):
    """The run's own storage, ``<target storage>/<run_id>`` (a folder or a bucket prefix)."""
    from .storage import Storage

    return Storage.open(remote_info(run)["dir"])


def on_shared_folder(run: dict) -> bool:
    """Whether the run's storage is a folder this machine sees (else object storage)."""
    from urllib.parse import urlparse

    return urlparse(str(remote_info(run)["dir"])).scheme in ("", "file")


def remote_home(run: dict) -> Path:
    return Path(run_storage(run).root) / "home"


def remote_run_dir(run: dict) -> Path:
    """The remote run folder (checkpoints, metrics.jsonl, log.txt, control/) as seen from here: in
    the shared folder, or, on object storage, the local mirror that `sync` keeps."""
    if not on_shared_folder(run):
        from ..home import run_dir

        return run_dir(run["id"])
    return remote_home(run) / "runs" / run["id"]
