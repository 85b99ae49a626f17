"""The page's HTTP routes: the static page, JSON views, the actions, and one event stream.

Light by construction: FastAPI, the ledger and the run folders, no torch. Nothing is polled
while nobody looks: each open page has one server-sent event stream, which looks at the ledger's
and the runs' file sizes once a second and sends the runs table only when one of them moved.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import LodgerError, RunNotFound
from ..home import home, run_dir
from ..ledger import Ledger
from . import actions, views
from .auth import Guard, Keys
from .machine import MachineView
from .series import SeriesCache

STATIC = Path(__file__).with_name("static")
STATIC_FILES = {"app.js": "text/javascript", "app.css": "text/css", "uPlot.iife.min.js": "text/javascript",
                "uPlot.min.css": "text/css", "uPlot.LICENSE": "text/plain"}
POLL_SECONDS = 1.0  # how often an open page's stream looks for changes
KEEPALIVE_SECONDS = 15.0
MAX_WIDTH = 4000  # buckets of a downsampled curve at most (a wide screen's pixels)


@dataclass
class Settings:
    keys: Keys
    serve_url: str = "http://127.0.0.1:8000"
    against: Path | None = None
    poll: float = POLL_SECONDS
    series: SeriesCache = field(default_factory=SeriesCache)
    machine: MachineView = field(default_factory=MachineView)
    lock: threading.Lock = field(default_factory=threading.Lock)


def fingerprint() -> tuple:
    """What changes when anything the page shows may have: the ledger's files, and each run's
    metrics and control state (sizes and times only: a few stats per run)."""
    marks: list = [views.verified_count]
    root = home()
    for name in ("ledger.db", "ledger.db-wal"):
        marks.append(_stamp(root / name))
    try:
        folders = sorted(os.scandir(root / "runs"), key=lambda e: e.name)
    except OSError:
        folders = []
    for entry in folders:
        marks.append((entry.name, _stamp(Path(entry.path) / "metrics.jsonl"),
                      _stamp(Path(entry.path) / "control" / "state.json"), _stamp(Path(entry.path) / "lock")))
    return tuple(marks)


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns


def build(settings: Settings):
    """The ASGI app: FastAPI's routes behind the token, Host and CSRF guard."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(LodgerError)
    async def lodger_error(request: Request, exc: LodgerError):
        return JSONResponse({"error": str(exc)}, status_code=404 if isinstance(exc, RunNotFound) else 409)

    @app.get("/")
    def index():
        page = (STATIC / "index.html").read_text(encoding="utf-8").replace("{{csrf}}", settings.keys.csrf)
        return Response(page, media_type="text/html; charset=utf-8")

    @app.get("/static/{name}")
    def static(name: str):
        if name not in STATIC_FILES:
            return Response("not found\n", status_code=404, media_type="text/plain")
        return Response((STATIC / name).read_bytes(), media_type=STATIC_FILES[name])

    @app.get("/favicon.ico")
    def favicon():
        return Response(status_code=204)

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/events")
    async def events(request: Request):
        return StreamingResponse(_stream(request, settings), media_type="text/event-stream",
                                 headers={"cache-control": "no-store", "x-accel-buffering": "no"})

    @app.get("/api/runs")
    def runs():
        with Ledger() as ledger:
            return views.runs_table(ledger)

    @app.get("/api/runs/{run_id}")
    def run(run_id: str):
        with Ledger() as ledger:
            return views.run_detail(ledger, run_id, settings.against)

    @app.get("/api/runs/{run_id}/series")
    def series(run_id: str, width: int = 1000):
        with Ledger() as ledger:
            found = ledger.find_run(run_id)
        width = max(10, min(width, MAX_WIDTH))
        with settings.lock:  # one reader at a time appends to a run's cached columns
            cached = settings.series.get(run_dir(found["id"]))
            return {"run": found["id"], "train": cached.points("train", width), "eval": cached.points("eval", width)}

    @app.get("/api/compare")
    def compare(runs: str):
        return views.compare_view([r for r in runs.split(",") if r])

    @app.get("/api/machine")
    def machine():
        with Ledger() as ledger, settings.lock:
            return settings.machine.snapshot(ledger)

    _actions(app, settings)
    return Guard(app, settings.keys)


def _actions(app: FastAPI, settings: Settings) -> None:
    """The routes that act; each needs the CSRF token (auth.refusal)."""

    @app.post("/api/runs/{run_id}/pause")
    async def pause(run_id: str, request: Request):
        mode = (await _body(request)).get("mode", "release")
        return {"message": await asyncio.to_thread(actions.pause, run_id, str(mode))}

    @app.post("/api/runs/{run_id}/continue")
    def continue_run(run_id: str):
        return {"message": actions.continue_run(run_id)}

    @app.post("/api/runs/{run_id}/resume")
    def resume(run_id: str):
        return {"message": actions.resume(run_id)}

    @app.post("/api/queue/{queue_id}/priority")
    async def priority(queue_id: int, request: Request):
        value = (await _body(request)).get("priority")
        if type(value) is not int:
            raise LodgerError("priority: send a whole number")
        return {"message": await asyncio.to_thread(actions.set_priority, queue_id, value)}

    @app.post("/api/chat")
    async def chat(request: Request):
        body = await _body(request)
        messages = body.get("messages")
        if not isinstance(body.get("run"), str) or not isinstance(messages, list):
            raise LodgerError("chat: send {\"run\": RUN, \"messages\": [...]}")
        return await asyncio.to_thread(actions.chat, settings.serve_url, settings.keys.token, body["run"], messages)



async def _body(request) -> dict:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        raise LodgerError("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise LodgerError("the request body must be a JSON object")
    return body


def _table() -> str:
    with Ledger() as ledger:
        return json.dumps(views.runs_table(ledger))


async def _stream(request, settings: Settings):
    """The runs table at once, then again whenever the fingerprint moves; a comment now and then so
    that a proxy or the browser keeps the connection."""
    last, quiet = None, 0.0
    while not await request.is_disconnected():
        now = await asyncio.to_thread(fingerprint)
        if now != last:
            last, quiet = now, 0.0
            yield f"event: runs\ndata: {await asyncio.to_thread(_table)}\n\n"
        elif quiet >= KEEPALIVE_SECONDS:
            quiet = 0.0
            yield ": still here\n\n"
        await asyncio.sleep(settings.poll)
        quiet += settings.poll
