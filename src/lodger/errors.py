"""Every error lodger raises on purpose. Only the CLI turns them into messages and exit codes."""


class LodgerError(Exception):
    """Base of all expected failures; the message is meant for the user as it is."""

    exit_code = 1


class JobFileError(LodgerError):
    """The job file cannot be read or does not validate; the message lists every problem."""

    exit_code = 2


class DataError(LodgerError):
    """A data file is missing, unreadable or has a bad line (file and line number are named)."""

    exit_code = 2


class ModelSourceError(LodgerError):
    """The model source cannot be resolved on this machine (lodger never downloads)."""

    exit_code = 2


class CheckpointError(LodgerError):
    """A checkpoint is damaged or none usable exists."""


class RunNotFound(LodgerError):
    """No run with the given id (or unique prefix) exists under $LODGER_HOME."""

    exit_code = 2


class RunStateError(LodgerError):
    """The run is in a state that does not allow the operation (e.g. resuming a finished run)."""


class StepFailed(LodgerError):
    """A training step could not be computed for a reason outside the model (a reward function
    failed, say): the step is undone, the state of the last finished step is committed as a
    checkpoint, and the run stops; `lodger resume` goes on from there once the cause is fixed."""


class RewardError(StepFailed):
    """A reward function raised, returned a non-number or the wrong number of values, or took
    longer than its limit; the message names the function, the step and the prompt's line."""


class LedgerError(LodgerError):
    """The ledger database cannot be opened or migrated."""


class LimitReached(LodgerError):
    """A run hit one of its resource limits; its checkpoint is committed and it stopped."""

    exit_code = 3


class PreflightError(LodgerError):
    """The job is not expected to fit in memory; nothing was written. The message says what would fit."""

    exit_code = 2


class PlanRefused(LodgerError):
    """No setting the planner may change makes the job fit (the message says by how much); nothing was written."""

    exit_code = 2


class DatasetError(LodgerError):
    """A dataset cannot be registered or changed as asked (the message says why and what to do)."""

    exit_code = 2


class ExportError(LodgerError):
    """An export cannot be made as asked (the message says why and what to do); nothing was written."""

    exit_code = 2


class EvalError(LodgerError):
    """`lodger eval` cannot score as asked: lm-eval missing, an unknown task, task data not in the
    local cache (the message names the task and how to make it available)."""

    exit_code = 2


class FederatedError(LodgerError):
    """A federated run cannot start or go on as asked (Flower process, round, message); the message
    names what and the fix."""


class GateRefused(LodgerError):
    """`lodger submit` refused a job: the message lists every failed check; nothing was submitted."""

    exit_code = 4

    def __init__(self, reasons: list[str], plan=None, job_hash: str | None = None):
        self.reasons, self.plan, self.job_hash = list(reasons), plan, job_hash
        listed = "\n".join(f"  - {r}" for r in self.reasons)
        super().__init__(f"submission refused, {len(self.reasons)} failed check(s); nothing was submitted:\n{listed}")


class FederationRefused(GateRefused):
    """`lodger federate` / `lodger submit --federated` (or a client before its first round) refused:
    every failed check is listed; no SuperNode was started, no app was run, nothing was sent."""

    def __init__(self, reasons: list[str], plan=None, job_hash: str | None = None):
        super().__init__(reasons, plan=plan, job_hash=job_hash)
        listed = "\n".join(f"  - {r}" for r in self.reasons)
        self.args = (f"federation refused, {len(self.reasons)} failed check(s); nothing was sent:\n{listed}",)


class DiskFull(LodgerError):
    """A write found its file system full (ENOSPC, or a quota): the message names the path, the space
    it needed and what was free there; what had been written of it was removed.

    ``then``: what to do once space is freed (e.g. `lodger resume RUN`), added by whoever knows."""

    def __init__(self, path, needed: int | str | None, free: int | None, what: str = "", then: str = "",
                 folder=None):
        self.path, self.needed, self.free, self.what, self.then = path, needed, free, what, then
        self.folder = folder if folder is not None else path  # what `df` is shown for
        need = (f"it needs {needed}" if isinstance(needed, str) else
                f"it needs {size_text(needed)}" if needed is not None else "it needs more room")
        there = f"{size_text(free)} free there" if free is not None else "the free space is unknown"
        super().__init__(f"no space left on the file system of {path}{f' ({what})' if what else ''}: {need}, "
                         f"{there}; what it had written was removed. Free some space (`df -h {self.folder}` "
                         f"shows that file system), then {then or 'run the command again'}")

    def explain(self, what: str | None = None, then: str | None = None, needed: int | str | None = None,
                path=None) -> "DiskFull":
        """The same error, saying more: what was being written, the whole need, what to do after."""
        return DiskFull(path or self.path, self.needed if needed is None else needed, self.free,
                        self.what if what is None else what, self.then if then is None else then, self.folder)


def size_text(n: int) -> str:
    """A byte count for people: 12 bytes, 3.4 KiB, 1.2 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
