"""A run from start to end: validate everything, create the run folder, build the training state,
restore the newest good checkpoint when resuming, run the loop, and record what happened.

Nothing is written for a new run until the job, the data and the model have all been checked.
The live state of the training process is train/state.py; this module is the run's lifecycle.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from .. import durable
from ..config import JobConfig, job_hash
from ..tomlfile import to_toml
from ..jobfile import load_job
from ..control import Control, clear_request
from ..data import make_sampler, read_jsonl, split_indices, tokenize
from ..preference import row_checker, tokenize_preference
from ..distributed import Ranks
from ..errors import DiskFull, LimitReached, PreflightError, RunStateError
from ..home import ledger_path, refuse_links_out, run_dir
from ..ledger import Ledger
from ..ledger.known import check_known
from ..ledger.values import NewRun
from ..recovery import complete_ledger
from ..report import plural
from ..restarts import mark_starting
from ..runlock import RunLock
from ..compare import segment_compute
from ..model import check_target_modules, model_folder, resolve_source, tokenizer_hash
from ..packing import example_lengths, make_planner

if TYPE_CHECKING:
    from ..train.state import Prepared, Session

JOB_FILE = "job.toml"


def prepare(job: JobConfig, device: str | None = None) -> Prepared:
    """Validate data (every line), resolve and cache the model, tokenise. Writes only caches.

    ``device`` skips choosing one here: the gate prepares a job for another machine's device."""
    from ..model import load_tokenizer
    from ..train.determinism import pick_device
    from ..train.state import Prepared

    objective = job.method.objective
    check, encode = None, tokenize
    if objective == "grpo":  # prompt lines (prompts.py); every reward function loaded once, before anything is written
        from ..prompts import check_row, tokenize_prompts
        from ..rewards import Rewards

        check, encode = check_row, tokenize_prompts
        rewards = Rewards(job.rewards, job.grpo)
        try:
            rewards.check()
        finally:
            rewards.close()
    elif objective != "sft":  # preference lines (preference.py): their own shape and tokenisation
        check = row_checker(objective)
        encode = partial(tokenize_preference, objective=objective, kl_block=job.training.batch_size)
    train_file = read_jsonl(job.data.train, check)
    eval_file = read_jsonl(job.data.eval, check) if job.data.eval is not None else None
    source = resolve_source(job.model.source)
    here = device is None  # a device named by the gate is another machine's: its library is not this one's
    device = device or pick_device(job)
    quantisation_problem(job, source, device if here else None)
    folder = model_folder(source)
    tokenizer = load_tokenizer(folder)
    tok_sha = tokenizer_hash(folder)
    check_target_modules(folder, job.method)
    train_set = encode(train_file, tokenizer, tok_sha, job.data.max_length)
    if eval_file is not None:
        eval_set = encode(eval_file, tokenizer, tok_sha, job.data.max_length)
        train_indices, eval_indices = list(range(len(train_set))), list(range(len(eval_set)))
    else:
        train_indices, eval_indices = split_indices(len(train_set), job.data.eval_fraction, job.training.seed)
        eval_set = train_set if eval_indices else None
    # Packed or not is settled here, from the data ("auto": by the unpacked padding share); packed
    # or not, the steps hold the same examples, so the step count is the same. The attention probe
    # at start only picks how packed examples are kept apart (train/state.py).
    lengths = example_lengths(train_set)
    sampler = make_sampler(job.training, train_indices, lengths)  # [training] order
    # A packed row must hold a whole example: a pair is two sequences of up to max_length each.
    longest = job.data.max_length * getattr(train_set, "per_example", 1)
    packing = False if objective == "grpo" else job.training.packing  # completions are sampled per step, padded
    planner = make_planner(job.training, longest, sampler, lengths, packing, device)
    steps = job.training.steps or planner.steps_for(job.training.epochs * len(train_indices))
    return Prepared(job, source, folder, tokenizer, tok_sha, train_file, eval_file, train_set, eval_set,
                    train_indices, eval_indices, steps, device, planner)


def quantisation_problem(job: JobConfig, source, device: str | None) -> None:
    """[method] base_bits refused before anything is written: on a GGUF file (already quantised;
    lodger dequantises it, and quantising that again stacks two rounding errors), or on a device
    bitsandbytes cannot serve here (``device`` None: the job is prepared for another machine)."""
    from ..errors import JobFileError

    bits = job.method.base_bits
    if bits is None:
        return
    if source.kind == "gguf":
        raise JobFileError(f"[method] base_bits = {bits} with [model] source = {job.model.source!r}: a GGUF file is "
                           "already quantised (lodger trains on it dequantised to fp32), and quantising that again "
                           "would stack a second rounding error on the first; use the original model's folder or "
                           "hub id as the source, or remove base_bits")
    from ..quant import device_problem

    problem = device_problem(bits, device) if device else None
    if problem:
        raise JobFileError(problem)


def prepare_job(path: Path, *, threads: int | None = None, world_size: int | None = None) -> Prepared:
    """A job file as the one value every later stage takes as it is: read and validated (user
    defaults, datasets), the thread count settled (every core when left out; recorded), then
    ``prepare``d (data, model, tokens, the step plan)."""
    job = load_job(path)
    if threads is not None:
        job.training.threads = threads
    if world_size is not None:
        job.training.world_size = world_size
    if job.training.threads is None:
        job.training.threads = len(os.sched_getaffinity(0))
    return prepare(job)


def preflight(prepared: Prepared, force: bool = False) -> dict:
    """Estimate peak memory; refuse (before anything is written) a job that will not fit."""
    from ..memory import estimate, memory_available, reference_examples, runtime_bytes, suggestions

    job = prepared.job
    config = json.loads((prepared.folder / "config.json").read_text())
    longest = int((prepared.train_set.offsets[1:] - prepared.train_set.offsets[:-1]).max())
    if prepared.planner is not None and prepared.planner.packed:  # rows fill up to the token budget
        longest = prepared.planner.row_tokens
    runtime = None if prepared.device == "cuda" else runtime_bytes(threads=job.training.threads, use_current=False)
    est = estimate(job, config, seq_len=min(longest, job.data.max_length), device=prepared.device,
                   runtime_bytes=runtime, examples=reference_examples(prepared))
    # Data-parallel ranks on the CPU share this machine's memory; on GPUs each has its own device.
    ranks = 1 if prepared.device == "cuda" else job.training.world_size
    if prepared.device == "cuda":
        import torch

        available, what = torch.cuda.mem_get_info()[0], "free GPU memory"
    else:
        available, what = memory_available(), "available memory"
    needed = est.total_bytes * ranks
    if job.limits.memory_gb and job.limits.memory_gb * 2**30 * ranks < available:  # the ceiling is per process
        available, what = int(job.limits.memory_gb * 2**30) * ranks, "[limits] memory_gb"
    summary = {"total_bytes": est.total_bytes, "largest": est.largest, "items": est.items,
               "available_bytes": available, "device": prepared.device, "forced": False, "processes": ranks}
    if needed > available:
        if not force:
            gib = 2**30
            fixes = "\n".join(f"  - {fix}" for fix in suggestions(est, job, available // ranks))
            each = f" ({ranks} processes of {est.total_bytes / gib:.2f} GiB)" if ranks > 1 else ""
            raise PreflightError(
                f"this job needs an estimated {needed / gib:.2f} GiB at its peak{each}, more than the "
                f"{available / gib:.2f} GiB of {what}; the largest item is {est.largest} "
                f"({est.items[est.largest] / gib:.2f} GiB). What would make it fit:\n{fixes}\n"
                "(`lodger estimate JOB` shows the breakdown; `--force` runs it anyway and records that)")
        summary["forced"] = True
    return summary


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


def new_run_record(run_id: str, job: JobConfig, name: str | None, total_steps: int, **extra) -> NewRun:
    """The ledger's record of a new run of ``job`` (``extra``: reproduces, managed, estimate)."""
    return NewRun(run_id=run_id, name=name, model=job.model.source, method=job.method.kind, job_hash=job_hash(job),
                  job_toml=to_toml(job.resolved_dict()), total_steps=total_steps, **extra)


def new_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def take_run(run_id: str) -> tuple[Control, RunLock]:
    """Make this process the one training ``run_id``: handlers first, then the lock (from the moment
    the lock names our pid, a pause request is caught, not fatal). A detached worker does this
    before validating and tokenising, so a pause sent while it starts is answered, not refused."""
    folder = run_dir(run_id)
    durable.fault_point("before_take_run")  # a test freezes a command here, between its checks and the lock
    # A limit is judged afresh by every process (`lodger resume` clears the user's and the agent's
    # requests itself; a user's hold survives a reboot).
    clear_request(folder, "limit")
    control = Control(folder).install_signal_handlers()
    return control, RunLock(folder)


def execute(run_id: str, prepared: Prepared, *, resuming: bool, quiet: bool = False,
            taken: tuple[Control, RunLock] | None = None) -> str:
    """Train a run in this process until it finishes or is interrupted; return the final status.

    With [training] world_size > 1 this process is one rank of a launched group (launch.start runs
    torchrun around the run; Ray Train's workers are ranks too). ``taken``: what ``take_run``
    returned, when this process took the run early (one process only)."""
    from .. import distributed as dist

    world = prepared.job.training.world_size
    ranks = Ranks()
    if world > 1:
        if not dist.inside_launch():
            raise RunStateError(f"run {run_id} trains with {world} processes: start it with lodger.lifecycle.launch.start, "
                                "which launches the ranks around it")
        ranks = dist.init(world, prepared.device)
        if ranks.rank > 0:
            return _execute_quiet_rank(run_id, prepared, resuming=resuming, ranks=ranks)
    return _execute(run_id, prepared, resuming=resuming, quiet=quiet, ranks=ranks, taken=taken)


def _execute_quiet_rank(run_id: str, prepared: Prepared, *, resuming: bool, ranks: Ranks) -> str:
    """A rank other than 0: the same training, no lock, no ledger, no files; rank 0 speaks for the run."""
    from ..report import Reporter
    from ..train.loop import train
    from ..train.state import Session

    control = Control(None).install_signal_handlers()  # SIGTERM/Ctrl-C only; rank 0 broadcasts what counts
    session = Session(run_id, prepared, None, quiet=True, control=control, ranks=ranks)
    session.recorder.reporter = Reporter(Path(os.devnull), session.total_steps, 0, quiet=True)
    if resuming:
        ckpt = session.checkpointer.agreed()  # in step with rank 0's _resume_state
        if ckpt is not None:
            session.checkpointer.restore(ckpt)
    session.ready_reference(lambda text: None)
    status = train(session.state, **session.collaborators())
    if status == "paused":  # as rank 0 does: give the memory back now
        sys.stdout.flush()
        os._exit(0)
    return status


def _execute(run_id: str, prepared: Prepared, *, resuming: bool, quiet: bool, ranks: Ranks,
             taken: tuple[Control, RunLock] | None) -> str:
    from ..train.loop import train
    from ..train.state import Session

    control, lock = taken or take_run(run_id)
    ledger = Ledger()
    try:
        _refuse_taken_meanwhile(ledger, run_id, resuming)
    except RunStateError:  # nothing of this process's was recorded: the run is someone else's to tell
        ledger.close()
        lock.release()
        raise
    try:
        session = Session(run_id, prepared, ledger, quiet=quiet, control=control, ranks=ranks)
    except Exception as exc:  # e.g. out of memory while loading: recorded, not silently left "created"
        ledger.set_status(run_id, "failed", error=f"{type(exc).__name__}: {exc}", step=0)
        ledger.close()
        lock.release()
        raise
    session.recorder.reporter = reporter = _reporter(session, quiet)
    _announce_holds(session, ledger, reporter)
    try:
        _start_segment(session, ledger, resuming=resuming)
        status = train(session.state, **session.collaborators())
        _record_end(session, ledger, status)
        if status == "paused":
            # Give the machine back now: skip interpreter teardown (seconds of freeing torch and
            # friends). The kernel drops the run lock only when the process is gone, so whoever
            # waits on the lock sees the memory truly free.
            reporter.close()
            ledger.close()
            limit = (session.control.release or {}).get("by") == "limit"
            if limit:
                print(f"error: run {run_id} stopped: {session.control.release.get('reason')}; its checkpoint "
                      f"at step {session.progress.step} is committed", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(LimitReached.exit_code if limit else 0)
        return status
    except BaseException as exc:
        if not isinstance(exc, KeyboardInterrupt):
            recorded = _record_failure(ledger, run_id, exc, session.progress.step)
            if isinstance(exc, DiskFull):
                raise _disk_full_of_run(exc, session, recorded) from None
        raise
    finally:
        reporter.close()
        ledger.close()
        lock.release()


def _refuse_taken_meanwhile(ledger: Ledger, run_id: str, resuming: bool) -> None:
    """This process holds the run's lock now, but its checks were made before: another process may
    have started (or finished) the run in between. A fresh start needs a run nobody started; a
    resume, one that has not finished. Otherwise it stops here, having changed nothing."""
    run = ledger.run(run_id)
    started = any(e["kind"] in ("started", "resumed") for e in ledger.events(run_id))
    if (not resuming and started) or (resuming and run["status"] == "finished"):
        what = "finished" if run["status"] == "finished" else f"{run['status']} at step {run['step']}"
        raise RunStateError(f"run {run_id} was {'started' if not resuming else 'finished'} by another process "
                            f"meanwhile (it is {what}); this one did nothing: `lodger show {run_id}`")


def _record_failure(ledger: Ledger, run_id: str, exc: BaseException, step: int) -> bool:
    """The run failed: say so in the ledger, unless the disk is too full for that too (then the
    next resume finds a run whose process is gone, as after a SIGKILL, and recovers it)."""
    try:
        ledger.update_run(run_id, pid=None)
        ledger.set_status(run_id, "failed", error=f"{type(exc).__name__}: {exc}", step=step)
    except DiskFull:
        return False
    return True


def _disk_full_of_run(exc: DiskFull, session: Session, recorded: bool) -> DiskFull:
    """A full disk stopped the run: which checkpoint is intact, and how to go on once space is free."""
    committed = session.store.committed()
    kept = f"checkpoint {committed[0][1].name} is intact" if committed else "no checkpoint had been committed yet"
    note = "" if recorded else "; the ledger could not record the failure either, resume completes it"
    return exc.explain(then=f"`lodger resume {session.run_id}` ({kept}{note})")


def _announce_holds(session: Session, ledger: Ledger, reporter) -> None:
    """A hold and its end go to the ledger and the log as they happen."""
    run_id = session.run_id

    def on_hold(request: dict) -> None:
        ledger.set_status(run_id, "held", "held", step=session.progress.step, by=request.get("by"),
                          reason=request.get("reason"))
        reporter.held(request.get("by"), request.get("reason"))

    def on_continue(request: dict, held: float) -> None:
        ledger.set_status(run_id, "running", "continued", step=session.progress.step, by=request.get("by"),
                          held_seconds=round(held, 3))
        reporter.continued(held)

    session.control.on_hold, session.control.on_continue = on_hold, on_continue


def _start_segment(session: Session, ledger: Ledger, *, resuming: bool) -> None:
    """Tidy the checkpoints, restore when resuming, record the segment's provenance and start."""
    run_id, reporter, progress = session.run_id, session.recorder.reporter, session.progress
    stale = session.store.clean_stale()
    if stale:
        reporter.message(f"removed {len(stale)} unfinished checkpoint folder(s)")
    session.store.prune()  # a crash between a commit and its prune leaves one too many
    run = ledger.run(run_id)
    lost_after = _resume_state(session) if resuming else 0
    session.ready_reference(reporter.message)
    progress.segment = run["segment"] + 1 if resuming else 0
    ledger.add_provenance(run_id, progress.segment, session.provenance())
    _write_provenance_json(session.dir, ledger.provenance(run_id))
    ledger.update_run(run_id, pid=os.getpid(), segment=progress.segment)
    earlier = segment_compute(ledger.events(run_id))
    session.limits.prior_cpu_seconds = sum(seg.get("cpu_seconds") or 0.0 for seg in earlier)
    session.limits.prior_wall_seconds = sum(seg.get("wall_seconds") or 0.0 for seg in earlier)
    lost = {"lost_after_step": lost_after} if resuming else {}
    world = session.world_size
    ledger.set_status(run_id, "running", "resumed" if resuming else "started",
                      step=progress.step, segment=progress.segment, pid=os.getpid(),
                      threads=session.job.training.threads, limits=session.applied_limits, **lost,
                      **({"world_size": world} if world > 1 else {}))
    session.control.announce("running")
    p = session.p
    reporter.message(f"run {run_id}: {'resuming at' if resuming else 'starting at'} step "
                     f"{progress.step}/{session.total_steps} "
                     f"({len(p.train_indices)} train / {len(p.eval_indices)} eval examples, "
                     f"{plural(session.job.training.threads, 'thread')}"
                     + (f" x {world} processes)" if world > 1 else ")"))
    reporter.started(progress.step)


def _record_end(session: Session, ledger: Ledger, status: str) -> None:
    control = session.control
    compute = session.meter.read()
    try:
        _record_status(session, ledger, status, compute)
    finally:
        if session.feed is not None:  # [report] to: the trackers get the run as the ledger ended it
            session.feed.close()
    control.announce(status)


def _record_status(session: Session, ledger: Ledger, status: str, compute) -> None:
    run_id, reporter, step, control = session.run_id, session.recorder.reporter, session.progress.step, session.control
    if status == "finished":
        adapter = session.write_adapter()
        ledger.update_run(run_id, pid=None)
        ledger.set_status(run_id, "finished", step=step, eval_loss=session.recorder.evals.get(step),
                          adapter=str(adapter), compute=compute)
        reporter.message(f"finished: {step} steps; adapter in {adapter}")
    elif status == "paused":
        request = control.release or {}
        ledger.update_run(run_id, pid=None)
        ledger.set_status(run_id, "paused", step=step, by=request.get("by"), reason=request.get("reason"),
                          compute=compute)
        reporter.message(f"paused at step {step} ({request.get('by')}: {request.get('reason')}); "
                         f"checkpoint committed; continue with `lodger resume {run_id}`")
    else:
        ledger.update_run(run_id, pid=None)
        ledger.set_status(run_id, "interrupted", step=step, reason=control.stop, compute=compute)
        reporter.message(f"interrupted ({control.stop}) at step {step}; continue with `lodger resume {run_id}`")


def _reporter(session: Session, quiet: bool):
    from ..report import Reporter

    return Reporter(session.dir / "log.txt", session.total_steps, 0, quiet=quiet)


def _resume_state(session: Session) -> int:
    """Restore the newest good checkpoint (or none); return the step the previous process reached."""
    rec, ledger, run_id = session.recorder, session.ledger, session.run_id

    def damaged(path: Path, reason: str, aside: Path) -> None:
        ledger.event(run_id, "damaged_checkpoint", checkpoint=path.name, reason=reason, moved_to=aside.name)
        rec.message(f"warning: checkpoint {path.name} is damaged ({reason}); moved aside to "
                    f"{aside.name}, using the previous one")

    ckpt = session.checkpointer.agreed(on_damaged=damaged)
    if ckpt is None:
        rec.message("no usable checkpoint: starting again from step 0")
        return rec.truncate_metrics(-1)
    differences = session.checkpointer.restore(ckpt)  # checks the data and model first (holders.RunFacts)
    reached = rec.truncate_metrics(ckpt.step)
    recovered = complete_ledger(ledger, run_id, session.dir, ckpt)
    if recovered["checkpoint"] or recovered["metrics"]:
        rec.message(f"ledger completed from the run folder: {recovered['metrics']} metric line(s)"
                    + (f", checkpoint {ckpt.path.name} recorded" if recovered["checkpoint"] else ""))
    if differences:
        ledger.event(run_id, "drift", step=ckpt.step, differences=differences)
        rec.message("warning: resuming on a different setup; the result is no longer bitwise "
                    "comparable with the uninterrupted run:\n  " + "\n  ".join(differences))
    rec.message(f"restored checkpoint {ckpt.path.name}")
    return reached


def _write_provenance_json(folder: Path, segments: list[dict]) -> None:
    durable.atomic_write(folder / "provenance.json",
                         json.dumps({"segments": segments}, indent=1, sort_keys=True, default=str).encode())


def resume_prepared(run_id: str, threads: int | None = None, world_size: int | None = None) -> Prepared:
    """Re-validate a run's recorded job for resuming (optionally at another thread count or world size)."""
    refuse_links_out(run_dir(run_id), f"run {run_id}")
    path = run_dir(run_id) / JOB_FILE
    if not path.exists():
        raise RunStateError(f"run {run_id}: its job file {path} is missing; the ledger holds a copy "
                            f"(`job_toml` in `lodger show {run_id} --json`): write it back to that path")
    return prepare_job(path, threads=threads, world_size=world_size)
