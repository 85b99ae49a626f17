"""The Ray backend: a Ray cluster reached through its job submission API.

``ray`` is imported only inside the calls that submit, stop or read logs; ``status`` asks the
dashboard's HTTP job API (``GET /api/jobs/<submission id>``) with urllib and a timeout, so that
`status`, `show` and `ls` stay light; everything else a remote run needs is backend-neutral (``remote/``).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from urllib.parse import quote

from .backend import STATUSES, Backend, ClusterUnreachable, RemoteError


def _auth_headers() -> dict[str, str]:
    """Ray's token (token auth is on by default in recent Ray), found where Ray's own client looks."""
    import os

    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return {}
    token = os.environ.get("RAY_AUTH_TOKEN")
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not token:
        try:
            token = path.read_text().strip()
        except OSError:
            return {}
    return {"Authorization": f"Bearer {token}"} if token else {}


def _get_json(address: str, path: str, timeout: float) -> dict | None:
    """GET ``path`` from the Ray dashboard's HTTP job API with plain urllib: `status`, `show` and `ls`
    ask it, and importing Ray's job client costs seconds. None on 404; ClusterUnreachable when it
    does not answer within ``timeout`` seconds or answers with something else than its JSON."""
    import json
    import socket
    import urllib.error
    import urllib.request

    base = address if "://" in address else f"http://{address}"
    request = urllib.request.Request(base.rstrip("/") + path, headers={"Accept": "application/json",
                                                                       **_auth_headers()})
    try:
        with urllib.request.urlopen(request, timeout=max(timeout, 0.01)) as response:
            body = response.read(1 << 20)  # a job's details are a few KiB; never read without a bound
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise ClusterUnreachable(address, timeout, f"its job API answered HTTP {exc.code}"
                                 + (" (Ray token auth: set RAY_AUTH_TOKEN)" if exc.code in (401, 403) else "")) from None
    except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError, OSError, ValueError) as exc:
        raise ClusterUnreachable(address, timeout, str(getattr(exc, "reason", exc))) from None
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise ClusterUnreachable(address, timeout, "it answered, but not as Ray's job API")
    return answer


def _client(address: str):
    from ray.job_submission import JobSubmissionClient  # heavy: only where Ray is really needed

    try:
        return JobSubmissionClient(address)
    except Exception as exc:  # ConnectionError, RuntimeError, auth errors: all mean "cannot use it"
        raise RemoteError(f"cannot reach the Ray cluster at {address}: {exc}; is it running (`ray status`), "
                          "and is the target's address its dashboard URL?") from None


class RayBackend(Backend):
    kind = "ray"
    title = "Ray"

    def connect(self, address: str) -> None:
        _client(address)

    def submit(self, info: dict, run_id: str, submission_id: str, job) -> None:
        from ..train.limits import COST_ENV, REMOTE_ENV
        from . import raytrain

        client = _client(info["address"])
        from .worker import entrypoint as worker_entrypoint
        from .worker import worker_env

        entrypoint = " ".join(shlex.quote(part) for part in worker_entrypoint(info, run_id, submission_id))
        env = {**worker_env(info), REMOTE_ENV: "1",
               COST_ENV: repr(float(info["cost_per_gpu_hour"])),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        # With world_size > 1 on one node the worker runs torchrun itself: it needs every rank's share.
        # On more nodes Ray Train asks for each rank's share; the driver only waits (raytrain.py).
        world = 0 if raytrain.wanted(job) else job.training.world_size
        gpus = world if job.training.device == "cuda" else 0
        try:
            client.submit_job(entrypoint=entrypoint, submission_id=submission_id, runtime_env={"env_vars": env},
                              entrypoint_num_cpus=(job.training.threads or 1) * world or None,
                              entrypoint_num_gpus=gpus or None, metadata={"lodger_run": run_id})
        except Exception as exc:
            raise RemoteError(f"the Ray cluster at {info['address']} refused submission {submission_id}: "
                              f"{exc}") from None

    def status(self, run: dict, timeout: float = 10.0) -> tuple[str | None, str | None]:
        from .place import remote_info

        if not run.get("remote_job_id"):
            return None, "never submitted"
        job = _get_json(remote_info(run)["address"], f"/api/jobs/{quote(run['remote_job_id'], safe='')}", timeout)
        if job is None:
            return None, f"Ray does not know submission {run['remote_job_id']}"
        status = job.get("status")
        if status not in STATUSES:
            raise ClusterUnreachable(remote_info(run)["address"], timeout, f"its job API answered status {status!r}")
        return status, job.get("message")

    def logs(self, run: dict) -> str:
        from .place import remote_info

        client = _client(remote_info(run)["address"])
        try:
            return client.get_job_logs(run["remote_job_id"])
        except Exception as exc:
            raise RemoteError(f"Ray has no logs for submission {run['remote_job_id']}: {exc}") from None

    def cancel(self, run: dict) -> bool:
        from .place import remote_info

        client = _client(remote_info(run)["address"])
        try:
            return bool(client.stop_job(run["remote_job_id"]))
        except Exception as exc:
            raise RemoteError(f"Ray could not stop submission {run['remote_job_id']}: {exc}") from None
