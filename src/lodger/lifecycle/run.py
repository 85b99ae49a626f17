"""A run's life from its caller's side: ``Run`` creates a run from a job file (its folder and
ledger row, atomically, after everything was checked) or opens an existing one, takes it, starts
or resumes it here, launches data-parallel ranks around it when its world size asks for it, or
hands it to a background worker, and returns an ``Outcome``. Commands, the agent, the demo, the
remote worker and the federated client start runs only through it."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import durable
from ..config import JobConfig, job_hash
from ..errors import RunStateError
from ..home import ledger_path, run_dir
from ..ledger import Ledger
from ..ledger.known import check_known
from ..ledger.values import NewRun
from ..owner.restarts import mark_starting
from ..config.tomlfile import to_toml
from .execute import Taken, execute, take_run
from .prepare import JOB_FILE, Prepared, preflight, prepare_job, resume_prepared


@dataclass(frozen=True)
class Outcome:
    """How the run's time in this process ended: "finished", "interrupted" (a checkpoint is
    committed; `lodger resume` goes on) or "paused" (only a rank other than 0 returns it: rank 0
    gives the machine back by exiting at once)."""

    run_id: str
    status: str

    @property
    def finished(self) -> bool:
        return self.status == "finished"


class Run:
    """One run: created (``create``) or opened by id, taken by this process (``take``: from then
    a pause request is answered), made ready to resume (``reopen``), then trained here
    (``start``, ranks launched around it when [training] world_size > 1; ``execute`` inside a
    group someone else launched) or in a background worker (``detach``)."""

    def __init__(self, run_id: str, prepared: Prepared | None = None) -> None:
        self.run_id = run_id
        self._prepared = prepared
        self._taken: Taken | None = None

    @classmethod
    def create(cls, job_path: Path, threads: int | None = None, *, name: str | None = None,
               reproduces: str | None = None, managed: bool = False, force: bool = False,
               run_id: str | None = None) -> Run:
        """Validate a job file and create its run (folder and ledger row) atomically; ``run_id`` is
        given only by a remote worker or the agent (its run keeps the id chosen for it)."""
        return cls(*create_run(job_path, threads, name=name, reproduces=reproduces, managed=managed, force=force,
                               run_id=run_id))

    @property
    def prepared(self) -> Prepared:
        if self._prepared is None:
            raise RunStateError(f"run {self.run_id}: its job was not prepared (Run.create or Run.reopen first)")
        return self._prepared

    def reopen(self, threads: int | None = None, world_size: int | None = None) -> Prepared:
        """The run's recorded job validated again for resuming (at another thread count or world
        size when given): data, model and tokens, before anything is written."""
        self._prepared = resume_prepared(self.run_id, threads, world_size)
        return self._prepared

    def take(self) -> Run:
        """Make this process the one training the run now, before it loads anything (one process
        only: with several ranks, rank 0 takes it once launched)."""
        self._taken = take_run(self.run_id)
        return self

    def start(self, *, resuming: bool, quiet: bool = False) -> Outcome:
        """Train the run in this process, or, with [training] world_size > 1 and no launched group
        around this process yet, replace this process with torchrun's rank supervisor, whose ranks
        train it (distributed.launch; never returns). A resume on another world size than its
        checkpoint's is refused first, before any process loads the model."""
        from .. import distributed as dist

        world = self.prepared.job.training.world_size
        if resuming:
            dist.refuse_other_world_size(self.run_id, dist.checkpoint_world_size(run_dir(self.run_id)), world)
        if world > 1 and not dist.inside_launch():
            threads = self.prepared.job.training.threads or 1  # settled by prepare_job
            dist.launch(self.run_id, world, threads, fresh=not resuming, quiet=quiet)
        return self.execute(resuming=resuming, quiet=quiet)

    def execute(self, *, resuming: bool, quiet: bool = False) -> Outcome:
        """Train the run in this process only: alone, or as one rank of a group already launched
        around it (torchrun's, Ray Train's)."""
        status = execute(self.run_id, self.prepared, resuming=resuming, quiet=quiet, taken=self._taken)
        return Outcome(self.run_id, status)

    def detach(self, *, fresh: bool, extra: list[str] | None = None, world_size: int | None = None) -> int:
        """Train the run in a background worker (its own session; it survives the terminal); return
        its pid once it has taken the run (one process) or its rank 0 trains (several)."""
        from .launch import spawn_worker, wait_until_running, wait_until_taken

        process = spawn_worker(self.run_id, fresh=fresh, extra=extra)
        if (world_size or self.prepared.job.training.world_size) == 1:
            wait_until_taken(self.run_id, process)  # under a second: the worker takes the run before loading
        else:
            wait_until_running(self.run_id, process)  # rank 0, a grandchild, takes the run once the ranks are up
        return process.pid


def create_run(job_path: Path, threads: int | None = None, *, name: str | None = None,
               reproduces: str | None = None, managed: bool = False, force: bool = False,
               run_id: str | None = None) -> tuple[str, Prepared]:
    """Validate a job file and create its run (folder and ledger row) atomically.

    ``run_id`` is given only by a remote worker: its run keeps the id of the local run it serves."""
    check_known(ledger_path())  # a ledger that lost runs is refused before anything is prepared or written
    prepared = prepare_job(job_path, threads=threads)
    job = prepared.job
    memory = preflight(prepared, force)
    name = name or job.name or Path(job_path).stem
    run_id = run_id or new_run_id(name)
    durable.write_folder(run_dir(run_id), {JOB_FILE: to_toml(job.resolved_dict()).encode()})
    mark_starting(run_dir(run_id))  # the agent leaves a "created" run alone while its creator lives
    with Ledger() as ledger:
        ledger.create_run(new_run_record(run_id, job, name, prepared.total_steps, reproduces=reproduces,
                                         managed=managed, estimate=memory))
    durable.fault_point("after_create_run")
    return run_id, prepared


def new_run_record(run_id: str, job: JobConfig, name: str | None, total_steps: int, **extra: Any) -> NewRun:
    """The ledger's record of a new run of ``job`` (``extra``: reproduces, managed, estimate)."""
    return NewRun(run_id=run_id, name=name, model=job.model.source, method=job.method.kind, job_hash=job_hash(job),
                  job_toml=to_toml(job.resolved_dict()), total_steps=total_steps, **extra)


def new_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"

