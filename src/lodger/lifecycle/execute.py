"""A run trained in this process: take it (handlers, then the lock), build its ``Session``, start or
resume its segment, run the loop, and record how it ended in the ledger and the log. With several
processes this one is one rank of a launched group; rank 0 speaks for the run."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import durable
from ..reporting.compare import segment_compute
from ..owner.control import Control, clear_request
from ..distributed import Ranks
from ..errors import DiskFull, LimitReached, RunStateError
from ..home import run_dir
from ..ledger import Ledger
from ..train.recovery import complete_ledger
from ..reporting.report import plural
from ..owner.runlock import RunLock
from .prepare import Prepared

if TYPE_CHECKING:
    from ..reporting.report import Reporter
    from .session import Session

Taken = tuple[Control, RunLock]


def take_run(run_id: str) -> Taken:
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
            taken: Taken | None = None) -> str:
    """Train a run in this process until it finishes or is interrupted; return the final status.

    With [training] world_size > 1 this process is one rank of a launched group (launch.start runs
    torchrun around the run; Ray Train's workers are ranks too). ``taken``: what ``take_run``
    returned, when this process took the run early (one process only)."""
    from .. import distributed as dist

    world = prepared.job.training.world_size
    ranks = Ranks()
    if world > 1:
        if not dist.inside_launch():
            raise RunStateError(f"run {run_id} trains with {world} processes: start it with lodger.lifecycle.Run.start, "
                                "which launches the ranks around it")
        ranks = dist.init(world, prepared.device)
        if ranks.rank > 0:
            return _execute_quiet_rank(run_id, prepared, resuming=resuming, ranks=ranks)
    return _execute(run_id, prepared, resuming=resuming, quiet=quiet, ranks=ranks, taken=taken)


def _execute_quiet_rank(run_id: str, prepared: Prepared, *, resuming: bool, ranks: Ranks) -> str:
    """A rank other than 0: the same training, no lock, no ledger, no files; rank 0 speaks for the run."""
    from ..reporting.report import Reporter
    from ..train.loop import train
    from .session import Session

    control = Control(None).install_signal_handlers()  # SIGTERM/Ctrl-C only; rank 0 broadcasts what counts
    session = Session(run_id, prepared, None, control=control, ranks=ranks,
                      open_log=lambda: Reporter(Path(os.devnull), prepared.total_steps, 0, quiet=True))
    if resuming:
        ckpt = session.checkpointer.agreed()  # in step with rank 0's _resume_state
        if ckpt is not None:
            session.checkpointer.restore(ckpt)
    session.ready_reference(lambda text: None)
    status = train(session.state, session.collaborators())
    if status == "paused":  # as rank 0 does: give the memory back now
        sys.stdout.flush()
        os._exit(0)
    return status


def _execute(run_id: str, prepared: Prepared, *, resuming: bool, quiet: bool, ranks: Ranks,
             taken: Taken | None) -> str:
    from ..train.loop import train

    control, lock = taken or take_run(run_id)
    ledger = Ledger()
    try:
        _refuse_taken_meanwhile(ledger, run_id, resuming)
        session = _session(run_id, prepared, ledger, control, ranks, quiet)
    except BaseException:  # nothing of the run's is open but what was just taken
        ledger.close()
        lock.release()
        raise
    reporter = session.recorder.reporter
    try:
        _start_segment(session, ledger, resuming=resuming)
        status = train(session.state, session.collaborators())
        _record_end(session, ledger, status)
        if status == "paused":
            _exit_paused(session, ledger, reporter)
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


def _session(run_id: str, prepared: Prepared, ledger: Ledger, control: Control, ranks: Ranks,
             quiet: bool) -> Session:
    """The run's Session, its log opened once the model is loaded. A failure while building it
    (out of memory while loading, say) is recorded, not silently left "created"; a refusal
    (RunStateError: another process took the run meanwhile) records nothing."""
    from ..reporting.report import Reporter
    from .session import Session

    opened: list[Reporter] = []

    def open_log() -> Reporter:
        opened.append(Reporter(run_dir(run_id) / "log.txt", prepared.total_steps, 0, quiet=quiet))
        return opened[-1]

    try:
        return Session(run_id, prepared, ledger, control=control, ranks=ranks, open_log=open_log)
    except Exception as exc:
        for reporter in opened:
            reporter.close()
        ledger.set_status(run_id, "failed", error=f"{type(exc).__name__}: {exc}", step=0)
        raise


def _exit_paused(session: Session, ledger: Ledger, reporter: Reporter) -> None:
    """Give the machine back now: skip interpreter teardown (seconds of freeing torch and friends).
    The kernel drops the run lock only when the process is gone, so whoever waits on the lock sees
    the memory truly free. A limit that paused the run is said, and the exit code says so too."""
    reporter.close()
    ledger.close()
    release = session.control.release or {}
    limit = release.get("by") == "limit"
    if limit:
        print(f"error: run {session.run_id} stopped: {release.get('reason')}; its checkpoint "
              f"at step {session.progress.step} is committed", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(LimitReached.exit_code if limit else 0)


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


def _start_segment(session: Session, ledger: Ledger, *, resuming: bool) -> None:
    """Tidy the checkpoints, restore when resuming, record the segment's provenance and start."""
    run_id, reporter, progress = session.run_id, session.recorder.reporter, session.progress
    stale = session.store.clean_stale()
    if stale:
        reporter.message(f"removed {len(stale)} unfinished checkpoint folder(s)")
    session.store.prune()  # a crash between a commit and its prune leaves one too many
    run = ledger.run(run_id)
    lost_after = _resume_state(session, ledger) if resuming else 0
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
                     f"{plural(session.job.training.threads or 0, 'thread')}"
                     + (f" x {world} processes)" if world > 1 else ")"))
    reporter.started(progress.step)


def _record_end(session: Session, ledger: Ledger, status: str) -> None:
    """The run's end in the ledger and the log; the trackers told, the owner answered."""
    control = session.control
    compute = session.meter.read()
    try:
        _record_status(session, ledger, status, compute)
    finally:
        if session.feed is not None:  # [report] to: the trackers get the run as the ledger ended it
            session.feed.close()
    control.announce(status)


def _record_status(session: Session, ledger: Ledger, status: str, compute: dict[str, Any]) -> None:
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


def _resume_state(session: Session, ledger: Ledger) -> int:
    """Restore the newest good checkpoint (or none); return the step the previous process reached."""
    rec, run_id = session.recorder, session.run_id

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


def _write_provenance_json(folder: Path, segments: list[dict[str, Any]]) -> None:
    durable.atomic_write(folder / "provenance.json",
                         json.dumps({"segments": segments}, indent=1, sort_keys=True, default=str).encode())
