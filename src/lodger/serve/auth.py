"""Who may talk to `lodger serve`: the API token, the Host check, and one log line per request.

Loopback is not a trust boundary: every local user (and every web page a local browser opens) can
reach 127.0.0.1. So every request carries the token (``Authorization: Bearer <token>``, compared in
constant time) unless the owner opted out with ``--no-auth``, and every request's ``Host`` header
must name this server (127.0.0.1, localhost, [::1] or the bound host, with our port): a page whose
name was re-pointed at 127.0.0.1 (DNS rebinding) sends its own name and is refused with 421.

``/health`` answers without a token, and then says only ``{"status": "ok"}`` (liveness); with the
token it also lists the served models and the requests in flight.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from .. import durable
from ..errors import LodgerError
from ..home import home

LOG = logging.getLogger("lodger.serve")
TOKEN_FILE = "serve-token"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
PUBLIC_PATHS = ("/health",)  # answered without a token, revealing liveness only
MAX_BODY_BYTES = 4 * 2**20
"""The largest request body read: several times the longest prompt a 128k-token context holds, as
text or as token ids. A larger one is a 413 before more of it is read (a 50 MB body once made the
server tokenise 50 M tokens and peak at 9.7 GB)."""


def token_path() -> Path:
    return home() / TOKEN_FILE


def read_token(path: Path | None = None) -> str | None:
    """The token in ``$LODGER_HOME/serve-token``, or None when there is none yet."""
    path = path or token_path()
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LodgerError(f"{path}: cannot read the serve token ({exc.strerror}); fix its permissions "
                          "or delete it to make a new one") from None
    if not text:
        raise LodgerError(f"{path} is empty: delete it and `lodger serve` makes a new token")
    return text


def ensure_token(path: Path | None = None) -> tuple[str, bool]:
    """(token, created): read the token file, or create it owner-only (0600) with a fresh token.

    Two servers starting at once agree on one token: the file is written aside and linked into
    place, which fails if the other got there first; then its token is read."""
    path = path or token_path()
    existing = read_token(path)
    if existing is not None:
        _tighten(path)
        return existing, False
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(token + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return read_token(path) or token, False
        durable.fsync_dir(path.parent)  # the token handed out must still be the token after a power cut
    finally:
        tmp.unlink(missing_ok=True)  # a temporary name: whether its removal survives a cut does not matter
    return token, True


def _tighten(path: Path) -> None:
    """A token file others can read is no secret: make it owner-only again, and say so."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        path.chmod(0o600)
        LOG.warning("%s was readable by others (mode %o); now 0600. Delete it for a fresh token if "
                    "someone may have read it.", path, mode)


def token_matches(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries ``token``; constant time in the token's bytes."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


def allowed_hosts(bound_host: str, port: int, extra: tuple[str, ...] = ()) -> frozenset[str]:
    """The Host header values this server answers: loopback names, the bound host, ``extra``; each
    with our port (and without it only on port 80, where clients leave it out)."""
    names = set(LOOPBACK_NAMES) | {n.lower() for n in extra}
    if bound_host not in ("0.0.0.0", "::", ""):
        names.add(f"[{bound_host}]" if ":" in bound_host and not bound_host.startswith("[") else bound_host.lower())
    return frozenset({f"{n}:{port}" for n in names} | (names if port == 80 else set()))


def error_body(message: str, kind: str, code: str | None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


@dataclass
class Guard:
    """What the middleware checks: the token (None: --no-auth) and the Host names it accepts."""

    token: str | None
    hosts: frozenset[str]


class GuardMiddleware:
    """ASGI middleware: Host check, token check, then one log line per request once its body is sent.

    Written against ASGI rather than as a FastAPI dependency so that it also covers 404s, 405s and
    the end of a streamed answer (the line reports the tokens, which are known only then)."""

    def __init__(self, app, guard: Guard):
        self.app, self.guard = app, guard

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        scope.setdefault("state", {})
        status = {"code": 0}

        async def send_logged(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                return await _send_error(send_logged, *refusal)
            scope["state"]["authenticated"] = True if self.guard.token is None else \
                token_matches(_header(scope, b"authorization"), self.guard.token)
            if not scope["state"]["authenticated"] and scope["path"] not in PUBLIC_PATHS:
                return await _send_error(send_logged, 401, "missing or wrong API token: send `Authorization: "
                                         "Bearer <token>` with the token in $LODGER_HOME/serve-token",
                                         "authentication_error", "invalid_api_key")
            body = await _bounded_body(scope, receive)
            if body is None:
                return await _send_error(send_logged, 413, f"the request body is over {MAX_BODY_BYTES // 2**20} MiB, "
                                         "the most this server reads: send a shorter prompt", "invalid_request_error",
                                         "request_too_large")
            await self.app(scope, _replay(body, receive), send_logged)
        finally:
            _log_request(scope, status["code"], time.monotonic() - started)

    def _refusal(self, scope) -> tuple | None:
        host = (_header(scope, b"host") or "").strip().lower()
        if host not in self.guard.hosts:
            return (421, f"this server does not answer for Host `{host[:100]}`: use http://127.0.0.1:PORT "
                    "(or pass --allow-host NAME to `lodger serve`)", "invalid_request_error", "host_not_allowed")
        return None


async def _bounded_body(scope, receive) -> list | None:
    """The request's body messages, read whole before the app sees them, or None once they pass
    MAX_BODY_BYTES (a Content-Length over it is refused before a byte is read)."""
    length = _header(scope, b"content-length")
    if length is not None and length.strip().isdigit() and int(length) > MAX_BODY_BYTES:
        return None
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages  # the client left: the app sees that, as it would have
        size += len(message.get("body", b""))
        if size > MAX_BODY_BYTES:
            return None
        if not message.get("more_body"):
            return messages


def _replay(messages: list, receive):
    """A receive that hands the app the body already read, then listens to the client again."""
    pending = list(messages)

    async def replayed():
        return pending.pop(0) if pending else await receive()

    return replayed


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


async def _send_error(send, status: int, message: str, kind: str, code: str) -> None:
    body = error_body(message, kind, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _log_request(scope, status: int, seconds: float) -> None:
    """`POST /v1/chat/completions 200 model=RUN prompt=12 completion=30 1234 ms held=run-a,run-b`."""
    state = scope.get("state", {})
    parts = [scope.get("method", "?"), scope.get("path", "?"), str(status or "-")]
    if "model" in state:
        parts.append(f"model={state['model']}")
    if "usage" in state:
        usage = state["usage"]
        parts.append(f"prompt={usage['prompt_tokens']} completion={usage['completion_tokens']}")
    parts.append(f"{seconds * 1000:.0f} ms")
    if "held" in state:
        parts.append(f"held={','.join(state['held']) or 'none'}")
    LOG.info(" ".join(parts))


__all__ = ["Guard", "GuardMiddleware", "allowed_hosts", "ensure_token", "read_token", "token_matches", "token_path"]
