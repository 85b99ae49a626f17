"""What a remote backend is: the interface lodger drives, and the registry of kinds.

A backend is the engine a target runs jobs on (``Target.kind``). It does six things: ``submit``
a job (first start and every resume alike), tell its ``status``, return its ``logs``, ``cancel``
it, and ``pause``/``resume`` it. Everything else (staging the files that leave, syncing results
home, the ledger) is backend-neutral and lives beside it in ``remote/``.

Pause and resume default to the neutral mechanism every lodger run polls: a request file in the
remote run folder in storage (``owner/control.py``). A backend with native suspend may override them.

To add a backend: a module with a ``Backend`` subclass, and one line in ``_BACKENDS``. Nothing
here imports an engine's client library; ``get_backend`` imports the module when a run needs it.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ..errors import LodgerError

# The neutral vocabulary of a submission's status (Ray's own words, which the ledger already holds).
STATUSES = ("PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")

# kind -> "module:class", imported only when a run of that kind is driven.
_BACKENDS: dict[str, str] = {"ray": "lodger.remote.ray:RayBackend"}


class RemoteError(LodgerError):
    """The remote target cannot be reached, refused the job, or its storage is unusable."""

    exit_code = 4


class ClusterUnreachable(RemoteError):
    """The engine at the target's address did not answer (refused, timed out, not its API)."""

    def __init__(self, address: str, seconds: float, why: str):
        super().__init__(f"cluster at {address} unreachable ({seconds:g} s): {why}")
        self.address, self.seconds, self.why = address, seconds, why


class Backend:
    """One engine lodger can run an approved job on. Subclasses implement the engine's calls."""

    kind = ""
    title = ""   # the engine's name in messages, e.g. "Ray"

    def connect(self, address: str) -> None:
        """Raise RemoteError unless the engine at ``address`` answers (checked before anything is written)."""
        raise NotImplementedError

    def submit(self, info: dict, run_id: str, submission_id: str, job) -> None:
        """Start `lodger _remote_worker RUN <dir>/job.toml` there as ``submission_id``.

        ``info`` is what the run was submitted with (address, dir, python, cost_per_gpu_hour)."""
        raise NotImplementedError

    def status(self, run: dict, timeout: float = 10.0) -> tuple[str | None, str | None]:
        """(status in STATUSES, message) of the run's current submission; (None, why) if the engine does
        not know it. Raises ClusterUnreachable when the engine does not answer within ``timeout`` seconds.

        It is asked by `status`, `show` and `ls`: it must not import the engine's client library."""
        raise NotImplementedError

    def logs(self, run: dict) -> str:
        """The engine's own log of the run's current submission (the entrypoint's stdout and stderr)."""
        raise NotImplementedError

    def cancel(self, run: dict) -> bool:
        """Stop the run's current submission (SIGTERM first); return whether it was still running."""
        raise NotImplementedError

    def pause(self, ledger, run: dict, mode: str, folder: Path) -> None:
        """Ask the run to release or hold: a request file in its storage folder, noticed by polling
        (and signalled too if its process verifiably runs on this machine)."""
        from ..owner.control import ask
        from ..durable import make_dirs

        make_dirs(folder)  # the request must outlast a power cut, so must its folder's name
        ask(folder, "user", mode, "lodger pause", ledger=ledger,
            event={"kind": "pause_requested", "mode": mode, "by": "user", "target": run["target"]})

    def resume(self, run: dict, folder: Path) -> None:
        """Void earlier pause requests: a live run notices and continues (a stopped one is submitted again)."""
        from ..owner.control import clear_request

        for requester in ("user", "agent"):  # the owner asked for it: earlier pause requests are void
            clear_request(folder, requester)


def kinds() -> tuple[str, ...]:
    """Every backend kind a target may name."""
    return tuple(_BACKENDS)


def check_kind(kind: str) -> str:
    """``kind`` if a backend of that kind exists; else ValueError naming the known ones."""
    if kind not in _BACKENDS:
        raise ValueError(f"unknown backend kind; known: {', '.join(kinds())}")
    return kind


def get_backend(kind: str) -> Backend:
    """The backend of ``kind``, its module imported now."""
    try:
        module, name = _BACKENDS[kind].split(":")
    except KeyError:
        raise RemoteError(f"no remote backend of kind {kind!r} (known: {', '.join(kinds())}); "
                          "fix: use one of them in the target") from None
    return getattr(importlib.import_module(module), name)()
