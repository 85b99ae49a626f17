"""What the page's buttons do, each through the function the matching command calls.

pause and continue: ``control.request_pause`` / ``request_continue`` (as `lodger pause` and
`lodger resume` of a held run). Resuming a stopped run loads the model, which this light server
must never do: it runs `lodger resume RUN --detach`, the command itself, in a process of its own.
The queue's order: ``Ledger.set_queue_priority`` (as `lodger queue priority`). The chat box:
`lodger serve`'s OpenAI API, with the token, from this server (the browser never holds the token).
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

from ..owner.control import request_continue, request_pause
from ..errors import LodgerError, RunStateError
from ..home import run_dir
from ..ledger import Ledger

RESUME_TIMEOUT = 300.0  # `resume --detach` returns once its worker holds the run: seconds, not minutes
CHAT_TIMEOUT = 300.0


def pause(run_id: str, mode: str) -> str:
    if mode not in ("release", "hold"):
        raise LodgerError(f"pause mode {mode!r}: use release or hold")
    with Ledger() as ledger:
        run = ledger.find_run(run_id)
        if run.get("target"):
            raise RunStateError(f"run {run['id']} runs on {run['target']}: pause it with `lodger pause {run['id']}`")
        asked = request_pause(run_dir(run["id"]), mode, ledger, why="lodger ui")
    return f"asked run {run['id']} (pid {asked.pid}) to {mode}" + (
        f"; {asked.note(run['id'], mode)}" if asked.continued else "")


def continue_run(run_id: str) -> str:
    with Ledger() as ledger:
        run = ledger.find_run(run_id)
        still = request_continue(run_dir(run["id"]), ledger)
    return f"run {run['id']} continues" + (f" once {', '.join(still)} lets go" if still else "")


def resume(run_id: str) -> str:
    """`lodger resume RUN --detach`, in its own process (it imports torch to check the job)."""
    with Ledger() as ledger:
        run = ledger.find_run(run_id)
    command = [sys.executable, "-m", "lodger.cli.main", "resume", run["id"], "--detach", "--quiet"]
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=RESUME_TIMEOUT, start_new_session=True)
    except subprocess.TimeoutExpired:
        raise LodgerError(f"`lodger resume {run['id']} --detach` did not return within {RESUME_TIMEOUT:.0f} s; "
                          "see `lodger logs` for the run") from None
    if done.returncode != 0:
        raise LodgerError((done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").removeprefix("error: "))
    return f"run {run['id']} resumed in the background"


def set_priority(queue_id: int, priority: int) -> str:
    with Ledger() as ledger:
        if not ledger.set_queue_priority(queue_id, priority):
            raise LodgerError(f"no queued job #{queue_id}; it may have started")
    return f"queued job #{queue_id} now has priority {priority}"


def chat(serve_url: str, token: str, run_id: str, messages: list[dict], max_tokens: int = 200) -> dict:
    """One answer from `lodger serve` (at ``serve_url``) for ``run_id``'s newest checkpoint."""
    body = json.dumps({"model": run_id, "messages": messages, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(f"{serve_url.rstrip('/')}/v1/chat/completions", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=CHAT_TIMEOUT) as answer:  # noqa: S310 - the owner's URL
            reply = json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {exc.code}"
        raise LodgerError(f"lodger serve at {serve_url} answered: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise LodgerError(f"no `lodger serve` answers at {serve_url} ({getattr(exc, 'reason', exc)}): start "
                          f"`lodger serve --run {run_id}` and pass its URL to `lodger ui --serve URL`") from None
    choice = (reply.get("choices") or [{}])[0]
    return {"content": (choice.get("message") or {}).get("content", ""), "model": reply.get("model"),
            "fingerprint": reply.get("system_fingerprint")}
