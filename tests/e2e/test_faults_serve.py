"""Faults: hostile requests to `lodger serve`, on 127.0.0.1, while a run trains and yields to it.

One server (`lodger serve --run RUN`, token and inference lease on) serves a run training in the
background (a tiny model, a checkpoint every 50 steps, 0.5 s of grace after each request). Each
case sends what a hostile or broken client sends, with bounded loops:

- a 50 MB body: a 413 before it is read further; the server's peak memory barely moves;
- a prompt past the context length, `max_tokens` of 10^9, NaN, Infinity and negative
  temperatures: a 4xx each, in OpenAI's error shape;
- eight answers generating at once, then a ninth request: a 429 (the queue is 8), and the eight
  slots come back when their clients go;
- 200 requests at once: each a 200 or a 429, never a 5xx or a dropped connection, never more than
  8 in flight;
- 100 connections sending their headers a byte at a time: a normal request is answered meanwhile;
- a second `serve` of the same run, and a server on a port in use: refused at once, saying why;
- afterwards the server is up, nothing is in flight, the hold on training is withdrawn and the run
  takes steps again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from helpers import describe, lodger_env, read_metrics, run_lodger, start_lodger, wait_until, write_job
from serve_helpers import Server, assert_error, start_server
from lodger.owner.control import clear_request, notify, read_requests, run_state, write_request
from lodger.owner.runlock import is_locked, lock_pid

pytestmark = pytest.mark.faults
MIB = 2**20
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


@dataclass
class Served:
    server: Server
    run_id: str
    folder: Path
    env: dict


def _peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _reset_peak(pid: int) -> float:
    """Reset the process's peak resident memory to what it holds now (``5`` into clear_refs: proc(5))
    and return it: without this, a peak reached earlier (loading the model) hides what came after."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _peak_mib(pid)


def _step(folder: Path) -> int:
    steps = [r["step"] for r in read_metrics(folder) if r["kind"] == "train"]
    return max(steps, default=0)


def _stop(folder: Path) -> None:
    import os
    import signal

    pid = lock_pid(folder)
    if pid is not None and is_locked(folder):
        os.kill(pid, signal.SIGTERM)
        try:
            wait_until(lambda: not is_locked(folder), 60, what="the run to stop", interval=0.05)
        except AssertionError:
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def served(tiny_model_dir, e2e_data, tmp_path_factory) -> Served:
    home, logs = tmp_path_factory.mktemp("hostile_serve_home"), tmp_path_factory.mktemp("hostile_serve_logs")
    env = lodger_env(home)
    env.pop("LODGER_API_TOKEN", None)
    job = write_job(logs / "job.toml", model=tiny_model_dir, train=e2e_data["train"], steps=100000, every_steps=50,
                    keep_last=2, eval_every=None, name="hostile", extra={"policy": {"inference_grace_seconds": 0.5}})
    detach = start_lodger(["run", job, "--detach"], env, logs)
    folder = home / "runs" / detach.run_id()
    server = None
    try:
        assert detach.wait(timeout=300) == 0, describe(detach)
        wait_until(lambda: (folder / "checkpoints").is_dir() and any((folder / "checkpoints").glob("step-*")), 300,
                   what="the first checkpoint", interval=0.05)
        # Held while the server loads the run's adapter (as test_serve.py does: the first load races a
        # prune otherwise), then let go.
        write_request(folder, "user", "hold", "the server starts")
        notify(lock_pid(folder))
        wait_until(lambda: run_state(folder).get("state") == "held", 60, what="the run to hold")
        server = start_server(["--run", detach.run_id()], env, logs)
        clear_request(folder, "user")
        notify(lock_pid(folder))
        wait_until(lambda: run_state(folder).get("state") == "running", 60, what="the run to continue")
        yield Served(server, detach.run_id(), folder, env)
    finally:
        if server is not None:
            server.close()
        _stop(folder)
        detach.close()


def test_a_50_mb_body_is_a_413_and_the_servers_memory_stays_bounded(served):
    """413 request_too_large for 50 MB (Content-Length and chunked); each raises the peak by under 64 MiB"""
    server, pid = served.server, served.server.proc.proc.pid
    huge = json.dumps({"model": served.run_id, "messages": [{"role": "user", "content": "a" * 50_000_000}]}).encode()
    before = _reset_peak(pid)
    assert_error(server.post(CHAT, huge), 413, code="request_too_large")
    grown = _peak_mib(pid) - before
    assert grown < 64, f"the server's peak memory grew by {grown:.0f} MiB for a refused 50 MB body"

    def chunks():
        yield b'{"model": "base", "messages": [{"role": "user", "content": "'
        for _ in range(500):
            yield b"a" * 100_000
        yield b'"}]}'

    before = _reset_peak(pid)
    chunked = httpx.post(server.url + CHAT, content=chunks(), timeout=120,
                         headers={"content-type": "application/json", **server.auth})  # no Content-Length
    assert_error(chunked, 413, code="request_too_large")
    grown = _peak_mib(pid) - before
    assert grown < 64, f"the server's peak memory grew by {grown:.0f} MiB for a refused 50 MB chunked body"


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"messages": [{"role": "user", "content": "red cat " * 5000}]}, "messages"),
    ("/v1/completions", {"prompt": "red cat " * 5000}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "red cat " * 300}]}, "messages"),
], ids=["chat_far_past", "completion_far_past", "chat_just_past"])
def test_a_prompt_past_the_context_length_is_a_400(served, path, body, param):
    """context_length_exceeded, naming the field (far past: refused before tokenising; just past: counted)"""
    response = served.server.post(path, {"model": served.run_id, "max_tokens": 4, **body})
    error = assert_error(response, 400, code="context_length_exceeded", param=param)
    assert "context length is" in error["message"]


def test_max_tokens_of_a_billion_is_a_400(served):
    """context_length_exceeded naming max_tokens"""
    response = served.server.post(CHAT, {"model": served.run_id, "messages": HI, "max_tokens": 10**9})
    error = assert_error(response, 400, code="context_length_exceeded")
    assert "max_tokens is 1000000000" in error["message"]


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b"-1", b"-0.5"])
def test_a_temperature_that_is_nan_infinite_or_negative_is_a_400(served, value):
    """temperature NaN, +-Infinity, negative: a 400 naming temperature"""
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": %s}' % (
        served.run_id.encode(), value)
    assert_error(served.server.post(CHAT, body), 400, param="temperature")


def _in_flight(server: Server) -> int:
    return server.get("/health").json()["in_flight"]


def test_a_ninth_request_while_eight_answers_generate_is_a_429_and_the_slots_come_back(served, tiny_model_dir):
    """eight streamed answers admitted: 8 in flight, a ninth chat is a 429 naming the limit; once the
    eight clients go, nothing is in flight and a chat is answered again"""
    server = served.server
    eos = json.loads((tiny_model_dir / "config.json").read_text())["eos_token_id"]
    # Greedy with the end token biased away, each answer runs to its 400 tokens: seconds each, one
    # after another (the engine generates one at a time), where sending nine requests takes a
    # fraction of one. A stream's headers come once it is admitted; its body is not read.
    long = {"model": served.run_id, "messages": HI, "max_tokens": 400, "temperature": 0, "stream": True,
            "logit_bias": {str(eos): -100}}
    short = {"model": served.run_id, "messages": HI, "max_tokens": 2}
    with httpx.Client(timeout=120, headers=server.auth) as client, contextlib.ExitStack() as streams:
        for _ in range(8):
            reply = streams.enter_context(client.stream("POST", server.url + CHAT, json=long))
            assert reply.status_code == 200, reply.read()
        assert _in_flight(server) == 8
        error = assert_error(server.post(CHAT, short), 429, code="rate_limit_exceeded", kind="rate_limit_error")
        assert "8 in flight or waiting" in error["message"], error
    # the clients went mid-answer: their generations stop and give their slots back
    wait_until(lambda: _in_flight(server) == 0, 120, what="the abandoned streams to leave the queue", interval=0.05)
    assert server.post(CHAT, short).status_code == 200


def test_200_requests_at_once_are_each_answered_200_or_429_never_more_than_8_in_flight(served):
    """200 concurrent chats: only 200s and 429s; /health never counts more than 8 in flight meanwhile;
    afterwards nothing is in flight"""
    server = served.server

    async def barrage() -> tuple[list, list[int]]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits, headers=server.auth) as client:
            async def one(n: int):
                try:
                    body = {"model": served.run_id, "max_tokens": 4,
                            "messages": [{"role": "user", "content": f"hi {n}"}]}
                    reply = await client.post(server.url + CHAT, json=body)
                    return reply.status_code
                except httpx.HTTPError as exc:
                    return type(exc).__name__

            seen: list[int] = []

            async def watch(done: asyncio.Event) -> None:
                while not done.is_set():
                    seen.append((await client.get(server.url + "/health")).json()["in_flight"])
                    await asyncio.sleep(0.01)  # polling an observed count while the barrage lasts

            done = asyncio.Event()
            watcher = asyncio.create_task(watch(done))
            codes = await asyncio.gather(*(one(n) for n in range(200)))
            done.set()
            await watcher
            return codes, seen

    answered, seen = asyncio.run(barrage())
    codes = Counter(answered)
    print(f"\n200 concurrent requests: {dict(codes)}; in flight at most {max(seen)} of {len(seen)} looks")
    assert set(codes) <= {200, 429} and codes[200] >= 1, codes
    assert max(seen) <= 8, f"{max(seen)} requests in flight at once; the queue is 8"
    wait_until(lambda: _in_flight(server) == 0, 120, what="nothing in flight")


def test_connections_held_open_byte_by_byte_do_not_stop_the_server(served):
    """100 connections dribbling headers a byte at a time; a normal request is answered meanwhile"""
    server = served.server
    held = []
    try:
        for _ in range(100):
            conn = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            conn.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n".encode())
            held.append(conn)
        for byte in b"X-Slow: 1\r\n":  # every connection one more byte, then a request in between
            for conn in held:
                conn.sendall(bytes([byte]))
        reply = server.post(CHAT, {"model": served.run_id, "messages": HI, "max_tokens": 2})
        assert reply.status_code == 200, reply.text
    finally:
        for conn in held:
            conn.close()
    assert server.get("/health").status_code == 200


def test_a_second_server_of_the_same_run_is_refused_naming_the_first(served, tmp_path):
    """exit non-zero at once: `already served by pid N at URL`; the first server still answers"""
    result = run_lodger(["serve", "--run", served.run_id, "--port", "0"], served.env, timeout=300)
    assert result.returncode != 0 and "Traceback" not in result.stderr, describe(result)
    pid = served.server.proc.proc.pid
    assert f"run {served.run_id} is already served by pid {pid} at http://127.0.0.1:{served.server.port}/v1" \
        in result.stderr, describe(result)
    assert served.server.get("/health").status_code == 200


def test_a_server_on_a_port_in_use_is_refused_before_loading_anything(served, tiny_model_dir):
    """`--port P` where the first server listens: 'is in use', exit non-zero, no traceback"""
    result = run_lodger(["serve", "--model", tiny_model_dir, "--port", str(served.server.port), "--no-yield"],
                        served.env, timeout=300)
    assert result.returncode != 0 and "Traceback" not in result.stderr, describe(result)
    assert f"--port {served.server.port}: 127.0.0.1:{served.server.port} is in use" in result.stderr, describe(result)


def test_after_it_all_the_server_is_up_and_training_goes_on(served):
    """health ok, nothing in flight; the serve hold is withdrawn and the run's step advances"""
    server, folder = served.server, served.folder
    assert server.proc.proc.poll() is None, describe(server.proc)
    assert server.get("/health").json()["in_flight"] == 0
    wait_until(lambda: "serve" not in read_requests(folder), 120, what="the inference hold to be withdrawn")
    now = _step(folder)
    wait_until(lambda: _step(folder) > now + 2, 300, what="the run to take steps again", interval=0.05)
    assert run_state(folder).get("state") == "running"
    assert "Traceback" not in server.stderr()
