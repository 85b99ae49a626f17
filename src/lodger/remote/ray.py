"""The Ray backend: a Ray cluster reached through its job submission API.

``ray`` is imported only inside the calls that talk to the cluster (status, ls, show and pause
must stay light); everything else a remote run needs is backend-neutral (``remote/``).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from .backend import Backend, RemoteError


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

        client = _client(info["address"])
        from .worker import entrypoint as worker_entrypoint
        from .worker import worker_env

        entrypoint = " ".join(shlex.quote(part) for part in worker_entrypoint(info, run_id, submission_id))
        env = {**worker_env(info), REMOTE_ENV: "1",
               COST_ENV: repr(float(info["cost_per_gpu_hour"])),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        # With world_size > 1 the worker runs torchrun itself (one node): it needs every rank's share.
        world = job.training.world_size
        gpus = world if job.training.device == "cuda" else 0
        try:
            client.submit_job(entrypoint=entrypoint, submission_id=submission_id, runtime_env={"env_vars": env},
                              entrypoint_num_cpus=(job.training.threads or 1) * world,
                              entrypoint_num_gpus=gpus or None, metadata={"lodger_run": run_id})
        except Exception as exc:
            raise RemoteError(f"the Ray cluster at {info['address']} refused submission {submission_id}: "
                              f"{exc}") from None

    def status(self, run: dict) -> tuple[str | None, str | None]:
        from . import remote_info

        info = remote_info(run)
        if not run.get("remote_job_id"):
            return None, "never submitted"
        client = _client(info["address"])
        try:
            job = client.get_job_info(run["remote_job_id"])
        except Exception as exc:
            return None, str(exc)
        return str(job.status.value if hasattr(job.status, "value") else job.status), job.message

    def logs(self, run: dict) -> str:
        from . import remote_info

        client = _client(remote_info(run)["address"])
        try:
            return client.get_job_logs(run["remote_job_id"])
        except Exception as exc:
            raise RemoteError(f"Ray has no logs for submission {run['remote_job_id']}: {exc}") from None

    def cancel(self, run: dict) -> bool:
        from . import remote_info

        client = _client(remote_info(run)["address"])
        try:
            return bool(client.stop_job(run["remote_job_id"]))
        except Exception as exc:
            raise RemoteError(f"Ray could not stop submission {run['remote_job_id']}: {exc}") from None
