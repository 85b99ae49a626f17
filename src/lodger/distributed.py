"""Data-parallel training: launch the ranks through torchrun, and the few collectives the loop needs.

With ``[training] world_size = N > 1`` the `lodger run` / `lodger resume` / `_worker` process
replaces itself (exec) with ``python -m torch.distributed.run --standalone --nproc-per-node N -m
lodger.cli.main _worker RUN``; each rank runs the same code (lifecycle/run.py and train/, with
train/sync.py's DataParallelSync). Rank 0 is the run as far as everyone else can tell: it holds
the run lock (so `lodger pause` signals it), writes the ledger, metrics, log and checkpoints.
Other ranks are quiet. torchrun tears every rank down when one dies, so a SIGKILL anywhere leaves
what a SIGKILL of a single process leaves: a resumable run.

world_size = 1 never imports torch.distributed.

What crosses between ranks (all deterministic for a fixed world size: gloo's allreduce sums in a
fixed order, and a two-rank sum is a single commutative addition):
- once per optimizer step, one all-reduce (SUM) of [every trainable gradient, the step's loss,
  rank 0's control flags]; the loss is already normalised by the whole step's target tokens
  across ranks, so the summed gradient is the gradient of the global batch;
- at a checkpoint, a gather of every rank's RNG state (plain JSON) to rank 0, then a barrier
  after rank 0 committed, so no rank runs ahead of a commit;
- at resume and rollback, a broadcast of the checkpoint step rank 0 chose.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import RunStateError

# Flags rank 0 adds to the step's all-reduce (the other ranks add zeros).
RELEASE, STOP, SAVE_DUE = 0, 1, 2
N_FLAGS = 3


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1


def inside_launch() -> bool:
    """Whether this process is one rank of a launched group (torchrun, or anything that sets the same env)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def checkpoint_world_size(run_folder: Path) -> int | None:
    """The world size of the run's newest committed checkpoint, from its manifest (no torch)."""
    from .checkpoint import newest_world_size

    return newest_world_size(Path(run_folder) / "checkpoints")


def refuse_other_world_size(run_id: str, recorded: int | None, now: int) -> None:
    if recorded is not None and recorded != now:
        raise RunStateError(
            f"run {run_id}: its checkpoint was written by {recorded} training process(es) and this resume "
            f"would use {now}; the data order and every rank's random state depend on that number, so the "
            f"run cannot continue exactly. Resume with `--world-size {recorded}`, or start a new run")


def launch(run_id: str, world_size: int, threads: int, *, fresh: bool, quiet: bool) -> None:
    """Replace this process with the rank supervisor (``python -m lodger.distributed``); never returns.

    The supervisor imports no torch; it runs torchrun in a session of its own and passes SIGTERM
    and Ctrl-C to the ranks, so they commit a checkpoint together and torchrun exits 0. (Signalled
    itself, torchrun tears its workers down and exits 1 with a traceback.)
    """
    command = [sys.executable, "-m", "lodger.distributed", "--standalone", f"--nproc-per-node={world_size}",
               "-m", "lodger.cli.main", "_worker", run_id, f"--world-size={world_size}", f"--threads={threads}"]
    command += (["--fresh"] if fresh else []) + ([] if quiet else ["--no-quiet"])
    # torchrun would set OMP_NUM_THREADS=1 (with a warning); the job's thread count is what we want,
    # and the same value at run and resume keeps the numerics fingerprint equal.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, command, env)


def supervise(torchrun_args: list[str]) -> int:
    """Run torchrun with these arguments; forward SIGTERM, SIGINT and SIGUSR1 to its ranks; return its code."""
    import signal
    import subprocess

    child = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *torchrun_args],
                             start_new_session=True,  # Ctrl-C reaches us, not torchrun
                             preexec_fn=_die_with_parent)  # SIGKILL of `lodger run` takes torchrun along

    def forward(signum, frame) -> None:
        ranks = _children(child.pid)
        for pid in ranks:  # only rank 0's answer counts; it broadcasts it to the others
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        if not ranks and signum != signal.SIGUSR1:
            os.killpg(child.pid, signal.SIGTERM)  # still starting: nothing to checkpoint yet

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, forward)
    return child.wait()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except (OSError, ValueError):
        return []


def init(world_size: int, device: str) -> Ranks:
    """Join the process group torchrun (or Ray Train) set up (gloo on CPU, nccl on GPU); check its size."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    _die_with_parent()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != world_size:
        raise RunStateError(f"launched with WORLD_SIZE={world} but the job says [training] world_size = "
                            f"{world_size}; launch as many processes as the job asks for")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    # A hold on rank 0 keeps the other ranks waiting inside a collective, for as long as the owner
    # holds: hence the long timeout. A dead rank is noticed at once (its socket closes), not by it.
    if not dist.is_initialized():  # Ray Train (remote/raytrain.py) made the group already: join it
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(days=30))
    # A rank that exits with the group still up can abort in gloo's threads at interpreter exit
    # ("terminate called without an active exception", exit -6): leave the group first.
    atexit.register(_leave_group)
    return Ranks(rank, world)


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _die_with_parent() -> None:
    """torchrun starts each rank in its own session (and the supervisor starts torchrun in one), so
    a SIGKILL of `lodger run` would leave torchrun and the ranks training on as orphans. Ask the
    kernel to SIGKILL this process when its parent dies: the whole tree goes down together, like a
    power cut."""
    import ctypes
    import signal

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def reduce_step(params, loss_sum, flags: list[float]):
    """Sum gradients, the step's loss (a scalar, or the loss and metric sums) and rank 0's flags over
    ranks in one all-reduce; return (loss, flags)."""
    import torch
    import torch.distributed as dist

    grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
    values = loss_sum.reshape(-1).float()  # the loss, then a preference objective's metric sums
    extra = torch.cat([values, torch.tensor(flags, dtype=torch.float32, device=loss_sum.device)])
    buffer = torch.cat([g.reshape(-1).float() for g in grads] + [extra])
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    offset = 0
    for q, g in zip(params, grads):
        n = g.numel()
        q.grad = buffer[offset:offset + n].view_as(g).to(g.dtype).clone()
        offset += n
    tail = buffer[offset:].tolist()  # .tolist() syncs with the device: once per step
    k = values.numel()
    summed = torch.tensor(tail[:k], dtype=loss_sum.dtype, device=loss_sum.device).reshape(loss_sum.shape)
    return summed, tail[k:]


def gather_rng(state: dict) -> list[dict] | None:
    """Every rank's RNG state (JSON-able) on rank 0, in rank order; None on the other ranks."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = [None] * world if rank == 0 else None
    dist.gather_object(state, out, dst=0)  # pickled on the wire only; written as JSON
    return out


def broadcast_int(value: int) -> int:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


def sum_across(values: list[float]) -> list[float]:
    """Each value summed over every rank (float64: counts stay exact)."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def rank_seed(seed: int, rank: int) -> int:
    """Rank r > 0 draws its dropout from its own stream; rank 0 keeps the job's seed."""
    import numpy as np

    return int(np.random.SeedSequence([seed, rank]).generate_state(1, dtype=np.uint64)[0] % 2**63)


if __name__ == "__main__":
    sys.exit(supervise(sys.argv[1:]))
