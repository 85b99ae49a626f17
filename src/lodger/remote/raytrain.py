"""More than one node: the ranks of one run as Ray Train workers (``TorchTrainer``), placed by Ray.

A job with ``[remote] nodes > 1`` cannot be one torchrun on one machine. Its Ray job's entrypoint
(`lodger _remote_worker`, the *driver*) creates or finds the run as a single-node job does, then
asks Ray Train for ``world_size`` workers (one per rank, ``threads`` CPUs and, on GPUs, one GPU
each; spread over the nodes as Ray sees fit). Ray Train sets up the process group (gloo on CPU,
nccl on GPU) and the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK); each worker then runs
lodger's ordinary rank code (`run.execute`), which joins the group it finds. So the training loop,
the step synchroniser (train/sync.py), the checkpoint contract and exact resume at the same world
size are the torchrun ones: no rendezvous of lodger's own.

Ray Train checkpoints nothing here (lodger's checkpoints are the run's); a worker that dies fails
the whole fit at once (``max_failures = 0``), and the next submission resumes from the newest good
checkpoint, as after a SIGKILL under torchrun. A pause or a limit ends the ranks by ``os._exit``
(memory back at once), which Ray Train reports as a failure: the driver reads what rank 0 wrote
(the run's state) to tell a pause from a failure, and exits as the single-node worker would.

Nothing imports ray or torch at module level: `status`, `ls` and `show` import this to ask
``wanted``.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

# What the ranks need of the driver's environment (the Ray job's runtime env sets it on the
# driver; Ray Train's workers are set from this, whatever Ray propagates by itself). Named, not
# by prefix: a worker's runtime env is stored in Ray's metadata and shown by its dashboard, so no
# secret (HF_TOKEN, AWS_SECRET_ACCESS_KEY) goes there; nodes have their own credentials.
_ENV_NAMES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM")
_ENV_PREFIX = "LODGER_"  # LODGER_HOME, LODGER_REMOTE, the price; never one that names a secret
_SECRET_WORDS = ("TOKEN", "SECRET", "KEY", "PASSWORD")
# A hold on rank 0 keeps the other ranks waiting inside a collective for as long as the owner
# holds (as under torchrun, see distributed.init): Ray Train's 30-minute default would end it.
_GROUP_TIMEOUT = timedelta(days=30)


def wanted(job) -> bool:
    """Whether ``job`` runs through Ray Train: more than one node declared."""
    return (job.remote.nodes or 1) > 1


def start(run_id: str, job_path: Path) -> str:
    """In the Ray job's driver: create or find the run, train it on Ray Train workers; the final status."""
    from ..ledger import Ledger
    from ..lifecycle.run import Run

    with Ledger() as ledger:
        resuming = ledger.has_run(run_id)
    if resuming:
        prepared = Run(run_id).reopen()
    else:
        from .. import durable
        from ..home import run_dir

        if run_dir(run_id).exists():  # a first start that died between its folder and its ledger row
            durable.remove_tree(run_dir(run_id))
        new = Run.create(job_path, run_id=run_id, managed=True)
        run_id, prepared = new.run_id, new.prepared
    failure = _fit(run_id, prepared.job, resuming)
    return _outcome(run_id, failure)


def rank_env(environ) -> dict[str, str]:
    """What of the driver's environment each rank gets: lodger's own settings, no secret."""
    return {k: v for k, v in environ.items() if k in _ENV_NAMES or (
        k.startswith(_ENV_PREFIX) and not any(word in k for word in _SECRET_WORDS))}


def _fit(run_id: str, job, resuming: bool) -> Exception | None:
    """Run the ranks on Ray Train; the exception fit() ended with, if any."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from ..home import home

    cuda = job.training.device == "cuda"
    env = rank_env(os.environ)
    trainer = TorchTrainer(
        _rank, train_loop_config={"run_id": run_id, "resuming": resuming, "env": env},
        torch_config=TorchConfig(backend="nccl" if cuda else "gloo",
                                 timeout_s=int(_GROUP_TIMEOUT.total_seconds())),
        scaling_config=ScalingConfig(num_workers=job.training.world_size, use_gpu=cuda,
                                     resources_per_worker={"CPU": job.training.threads or 1},
                                     placement_strategy="SPREAD"),
        run_config=RunConfig(name=f"{run_id}-{os.getpid()}", storage_path=str(home() / "raytrain"),
                             failure_config=FailureConfig(max_failures=0), worker_runtime_env={"env_vars": env}))
    try:
        trainer.fit()
    except Exception as exc:  # noqa: BLE001 - a pause ends the ranks too; _outcome reads which it was
        return exc
    return None


def ignore_pause_signal() -> None:
    """Ignore SIGUSR1 in this whole process, from any thread.

    The ranks run in a thread of a Ray Train worker, where Python's signal module cannot install
    lodger's handlers, and SIGUSR1's default action ends a process. On a head that is also this
    machine, `lodger pause` verifies rank 0 holds the run's lock and signals it: ignored, the
    request file it wrote first is what rank 0 answers (it polls request files with
    LODGER_REMOTE=1). libc's ``signal`` sets the process-wide disposition from any thread; Python
    has no handler of its own for SIGUSR1 to disagree with it."""
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
    libc.signal(int(signal.SIGUSR1), 1)  # 1 = SIG_IGN


def _rank(config: dict) -> None:
    """One rank inside a Ray Train worker: lodger's rank code in the process group Ray Train made."""
    os.environ.update(config["env"])
    ignore_pause_signal()
    from ..lifecycle.run import Run

    rank = Run(config["run_id"])
    rank.reopen()
    rank.execute(resuming=config["resuming"], quiet=True)


def _outcome(run_id: str, failure: Exception | None) -> str:
    """What the run said about its end (rank 0 writes it before it exits); exit 3 at a limit, as
    the single-node worker does; a failure that was no pause is raised."""
    from ..errors import LimitReached, RunStateError
    from ..ledger import Ledger

    with Ledger() as ledger:
        status = ledger.run(run_id)["status"]
        paused = ledger.last_event(run_id, "paused") if status == "paused" else None
    if paused is not None:
        if paused["data"].get("by") == "limit":
            raise LimitReached(f"run {run_id} stopped: {paused['data'].get('reason')}; its checkpoint at step "
                               f"{paused['data'].get('step')} is committed")
        return status
    if failure is not None or status != "finished":
        raise RunStateError(f"run {run_id}: the Ray Train workers ended with the run {status}"
                            + (f": {failure}" if failure is not None else ""))
    sys.stdout.flush()
    return status
