"""Real `lodger serve` processes on 127.0.0.1 for the serve tests, and OpenAI-shaped error checks.

A server started without --token or --no-auth creates `$LODGER_HOME/serve-token` on first use;
``Server`` reads it once the server answers, and its clients and ``post`` send it.
"""

from __future__ import annotations

import json
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from helpers import Running, start_lodger, wait_until

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
ERROR_KEYS = {"message", "type", "param", "code"}
SERVER_START_TIMEOUT = 240  # imports and model loading, on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: Running
    port: int
    home: Path
    token: str | None = None  # what clients send by default (None: --no-auth)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def auth(self) -> dict:
        return {"authorization": f"Bearer {self.token}"} if self.token else {}

    def client(self, api_key: str | None = None) -> openai.OpenAI:
        # no retries: a 429 or a 5xx must reach the test as it is
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or self.token or "none", max_retries=0,
                             timeout=120)

    def post(self, path: str, body, headers: dict | None = None, **kw) -> httpx.Response:
        """POST with the server's token (unless ``headers`` says otherwise)."""
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.url + path, content=content, timeout=120,
                          headers={"content-type": "application/json", **self.auth, **(headers or {})}, **kw)

    def get(self, path: str, headers: dict | None = None, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=120, headers={**self.auth, **(headers or {})}, **kw)

    def stderr(self) -> str:
        return self.proc.stderr()

    def close(self) -> None:
        if self.proc.proc.poll() is None:
            self.proc.proc.terminate()
            try:
                self.proc.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.close()


def start_server(args: list[str], env: dict[str, str], log_dir: Path, token: str | None = None) -> Server:
    """`lodger serve ARGS --port P`; returns once it answers HTTP (/health needs no token).

    ``token``: what clients send; by default the one the server keeps in $LODGER_HOME/serve-token
    (none with --no-auth)."""
    port = free_port()
    proc = start_lodger(["serve", *args, "--port", str(port)], env, log_dir)
    server = Server(proc, port, Path(env["LODGER_HOME"]))

    def answers() -> bool:
        try:
            return httpx.get(server.url + "/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(answers, SERVER_START_TIMEOUT, proc.proc, what="the server to answer", output=proc,
                   interval=0.05)
    except BaseException:
        server.close()
        raise
    token_file = server.home / "serve-token"
    if token is None and "--no-auth" not in args and token_file.exists():
        token = token_file.read_text().strip()
    server.token = token
    return server


def assert_error(response: httpx.Response, status: int, *, code: str | None = None, param: str | None = None,
                 kind: str | None = None) -> dict:
    """An OpenAI-shaped error: {"error": {"message", "type", "param", "code"}} with this status."""
    assert response.status_code == status, f"{response.status_code} {response.text}"
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    if code is not None:
        assert error["code"] == code, body
    if param is not None:
        assert error["param"] == param, body
    if kind is not None:
        assert error["type"] == kind, body
    return error
