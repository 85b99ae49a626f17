"""What the user sees of a bug: one line naming what failed and a log file holding the traceback.

A traceback on the terminal is noise to a user and hides the one fact they need (where to look,
what to send). It goes to ``$LODGER_HOME/logs/crash-*.txt`` (owner-only: it can quote paths and
data), and, for a process that trains a run in the background, also to the run's log.txt, which
is where `lodger logs RUN` and the sync of a remote run look.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import click

RUN_LOG = "lodger.run_log"
"""Key in click's shared ``ctx.meta``: the log.txt of the run this process trains, once known."""


def log_to_run(run_id: str) -> None:
    """Tell the crash handler which run this process trains: its traceback also goes to that run's log."""
    from ..home import run_dir

    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta[RUN_LOG] = run_dir(run_id) / "log.txt"


def reader_left(exc: Exception) -> bool:
    """Whether ``exc`` only says that whoever read our stdout has gone (a closed pipe), not a bug."""
    if not isinstance(exc, BrokenPipeError):
        return False
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return True
    return False


def _logs_dir() -> Path:
    """$LODGER_HOME/logs (0700); when the home itself is unusable, a private folder in the temp dir."""
    from .. import durable
    from ..home import home, private_temp_dir

    try:
        folder = durable.make_dirs(home() / "logs")
    except Exception:  # the home may be the very thing that is broken (a file, unwritable)
        folder = private_temp_dir(Path(tempfile.gettempdir()), "lodger-logs")
    return folder


def _report(exc: BaseException) -> str:
    from .. import __version__

    lines = [f"command: {' '.join(sys.argv)}", f"time: {time.strftime('%Y-%m-%d %H:%M:%S %z')}",
             f"lodger {__version__}, python {platform.python_version()}, {platform.platform()}",
             f"LODGER_HOME: {os.environ.get('LODGER_HOME', '(unset: ~/.lodger)')}", ""]
    return "\n".join(lines) + "".join(traceback.format_exception(exc))


def write_crash_log(exc: BaseException) -> Path:
    """Write the traceback to a new owner-only file under $LODGER_HOME/logs and return its path."""
    folder = _logs_dir()
    stem = f"crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    for n in range(100):  # O_EXCL: never follow or reuse a file someone else put there
        path = folder / (stem + (f"-{n}" if n else "") + ".txt")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(_report(exc))
            fh.flush()
            os.fsync(fh.fileno())
        from .. import durable

        durable.fsync_dir(folder)  # the path the user is told to send must still be there after a cut
        return path
    raise FileExistsError(f"{folder}: no free name for a crash log")


def _append_to_run_log(path: Path, exc: BaseException) -> bool:
    from .. import durable
    from ..errors import LodgerError

    try:
        with durable.open_append(path) as fh:  # never through a link planted in the run folder
            fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} error: unexpected {type(exc).__name__}: {exc}\n")
            fh.write("".join(traceback.format_exception(exc)))
        return True
    except (OSError, LodgerError):
        return False


def _command_path(exc: BaseException, ctx: click.Context) -> str:
    """The full command that failed (`lodger target ls`): the deepest click context on the way down."""
    deepest, tb = ctx, exc.__traceback__
    while tb is not None:
        found = tb.tb_frame.f_locals.get("ctx")
        if isinstance(found, click.Context):
            deepest = found
        tb = tb.tb_next
    return deepest.command_path


def report_unexpected(exc: Exception, ctx: click.Context) -> str:
    """Log ``exc`` and return the one line for stderr (the command, the error, where the traceback is)."""
    command = _command_path(exc, ctx)
    what = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
    if len(what) > 300:
        what = what[:300] + "..."
    try:
        where = str(write_crash_log(exc))
    except Exception as log_exc:  # nowhere to write: the traceback still must not be lost
        traceback.print_exception(exc, file=sys.stderr)
        where = f"(not written: {log_exc}; it is printed above)"
    run_log = ctx.meta.get(RUN_LOG)
    if run_log is not None and _append_to_run_log(run_log, exc):
        where += f" and in {run_log}"
    return (f"error: {command} failed unexpectedly ({what}); the traceback is in {where} "
            "(please include it if you report this)")
