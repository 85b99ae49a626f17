"""Who may see the owner's page and press its buttons: `lodger serve`'s token and Host rules, for a browser.

A browser cannot be told to send ``Authorization: Bearer``, so the token reaches it once, in the
URL `lodger ui` prints (``/login?token=...``); the answer sets a session cookie (HttpOnly: no script
reads it; SameSite=Strict: no other site's page makes the browser send it) and sends the browser
on to ``/`` without the token in its address bar. Scripts may send the bearer token instead.

Every request that acts (POST) must also carry the page's CSRF token in ``X-Lodger-CSRF``: a page
from another origin can neither read our page (no CORS) to learn it, nor set that header on a
cross-site request without a preflight we never grant. An ``Origin`` header that names another
site is refused outright. Together: nothing from another origin can pause a run.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass, field
from urllib.parse import parse_qs

from ..serve.auth import allowed_hosts, token_matches

COOKIE = "lodger_ui"
CSRF_HEADER = b"x-lodger-csrf"
PUBLIC = ("/login", "/health")
# No script from anywhere but this server, no framing (a pause button under someone else's page is
# a click away from being pressed), no referrer (the login URL holds the token).
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                                 b"img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; "
                                 b"base-uri 'none'; form-action 'self'"),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]


@dataclass
class Keys:
    """The API token (shared with `lodger serve`), this server's session and CSRF secrets, and the
    Host names it answers. Sessions are this process's: a restarted `lodger ui` asks for the URL again."""

    token: str
    hosts: frozenset[str]
    session: str = field(default_factory=lambda: secrets.token_urlsafe(32))

    @property
    def csrf(self) -> str:
        return hmac.new(self.session.encode(), b"csrf", "sha256").hexdigest()

    @classmethod
    def make(cls, token: str, host: str, port: int) -> "Keys":
        return cls(token, allowed_hosts(host, port))


def header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def cookie(scope, name: str) -> str | None:
    for part in (header(scope, b"cookie") or "").split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return None


def session_ok(scope, keys: Keys) -> bool:
    """The request carries this server's session cookie, or the API token as a bearer token."""
    given = cookie(scope, COOKIE)
    if given is not None and hmac.compare_digest(given.encode(), keys.session.encode()):
        return True
    return token_matches(header(scope, b"authorization"), keys.token)


def refusal(scope, keys: Keys) -> tuple[int, str] | None:
    """Why a request is refused (status, message), or None. Order: Host, then who, then CSRF."""
    host = (header(scope, b"host") or "").strip().lower()
    if host not in keys.hosts:
        return 421, f"this page does not answer for Host `{host[:100]}`: use the URL `lodger ui` printed"
    origin = header(scope, b"origin")
    if origin is not None and origin.lower() not in {f"http://{h}" for h in keys.hosts}:
        return 403, "a request from another site's page is refused"
    if scope["path"] in PUBLIC:
        return None
    if not session_ok(scope, keys):
        return 401, "not signed in: open the URL `lodger ui` printed (it carries the token once)"
    if scope.get("method") not in ("GET", "HEAD") and not token_matches(header(scope, b"authorization"), keys.token):
        given = header(scope, CSRF_HEADER) or ""
        if not hmac.compare_digest(given.encode(), keys.csrf.encode()):
            return 403, "missing or wrong CSRF token: reload the page"
    return None


def login_token(scope) -> str:
    return (parse_qs((scope.get("query_string") or b"").decode("latin-1")).get("token") or [""])[0]


class Guard:
    """ASGI middleware: every response gets the security headers; refused requests get a plain-text
    reason; ``/login?token=`` sets the session cookie."""

    def __init__(self, app, keys: Keys):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_secured(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)

        refused = refusal(scope, self.keys)
        if refused is not None:
            return await _plain(send_secured, *refused)
        if scope["path"] == "/login":
            return await self._login(scope, send_secured)
        await self.app(scope, receive, send_secured)

    async def _login(self, scope, send) -> None:
        if not token_matches(f"Bearer {login_token(scope)}", self.keys.token):
            return await _plain(send, 401, "wrong or missing token: open the URL `lodger ui` printed")
        cookie_value = f"{COOKIE}={self.keys.session}; HttpOnly; SameSite=Strict; Path=/".encode()
        await send({"type": "http.response.start", "status": 303,
                    "headers": [(b"location", b"/"), (b"set-cookie", cookie_value), (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


async def _plain(send, status: int, text: str) -> None:
    body = (text + "\n").encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
