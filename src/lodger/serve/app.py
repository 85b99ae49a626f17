"""The HTTP app: OpenAI-compatible chat and text completions, models, health.

Every error has OpenAI's shape ({"error": {"message", "type", "param", "code"}}), whatever raised it
(our checks, an unknown route, a wrong method, a bug); the server keeps serving. Requests beyond
``max_queue`` (in flight plus waiting) get 429. Each admitted request is generated in a thread of
its own that owns the request's queue slot and inference lease from the moment it is admitted:
both are given back in that thread's ``finally``, whatever happens to the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from .auth import Guard, GuardMiddleware
from .engine import Engine, Penalties, describe
from .lease import InferenceLease
from .schema import ApiError, ChatRequest, CompletionRequest, Sampling

LOG = logging.getLogger("lodger.serve")


@dataclass
class ServeState:
    """What the routes share: the engine, the lease, and the count of admitted requests."""

    engine: Engine
    lease: InferenceLease
    max_queue: int
    reload_seconds: float
    admitted: int = 0
    admit_lock: threading.Lock = field(default_factory=threading.Lock)
    stop_reload: threading.Event = field(default_factory=threading.Event)

    def admit(self) -> None:
        with self.admit_lock:
            if self.admitted >= self.max_queue:
                raise ApiError(429, f"too many requests: {self.max_queue} in flight or waiting; retry shortly",
                               code="rate_limit_exceeded", kind="rate_limit_error")
            self.admitted += 1

    def leave(self) -> None:
        with self.admit_lock:
            self.admitted -= 1


def get_state(request: Request) -> ServeState:
    return request.app.state.serve


# -- the app ---------------------------------------------------------------------------------------

def create_app(engine: Engine, *, guard: Guard | None = None, max_queue: int = 8,
               lease: InferenceLease | None = None, reload_seconds: float = 0.5) -> FastAPI:
    """The app; ``guard`` (token and Host names) is checked on every request when given."""
    state = ServeState(engine, lease or InferenceLease(enabled=False), max_queue, reload_seconds)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=reload_loop, args=(state,), daemon=True, name="lodger-reload").start()
        yield
        state.stop_reload.set()
        state.lease.close()

    app = FastAPI(title="lodger", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.serve = state
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id}", retrieve_model, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_middleware(CatchAll)
    if guard is not None:  # outermost: refuses before anything runs, and logs what CatchAll answered
        app.add_middleware(GuardMiddleware, guard=guard)
    return app


def reload_loop(state: ServeState) -> None:
    """Follow newly committed checkpoints; an error is logged (once until it changes) and retried."""
    last_error = None
    while not state.stop_reload.wait(state.reload_seconds):
        try:
            for version in state.engine.refresh_all():
                LOG.info("now serving %s", version)
            last_error = None
        except Exception as exc:  # the thread must outlive a bad checkpoint: the next one may be fine
            message = f"{type(exc).__name__}: {exc}"
            if message != last_error:
                LOG.warning("reloading an adapter failed (%s); retrying every %.1f s", message,
                            state.reload_seconds)
            last_error = message


# -- errors ------------------------------------------------------------------------------------------

async def api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    if exc.status_code == 404:
        error = ApiError(404, f"no endpoint {request.url.path}: the endpoints are /v1/chat/completions, "
                         "/v1/completions, /v1/models, /v1/models/{id} and /health", code="not_found")
    elif exc.status_code == 405:
        allowed = {k.lower(): v for k, v in (exc.headers or {}).items()}.get("allow", "?")
        error = ApiError(405, f"{request.method} is not allowed on {request.url.path} (allowed: {allowed})",
                         code="method_not_allowed")
    else:
        error = ApiError(exc.status_code, str(exc.detail), code=None)
    return JSONResponse(error.body(), status_code=error.status, headers=exc.headers)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"] if p not in ("body", "path", "query")) or None
    return JSONResponse(ApiError(400, f"{param}: {first['msg']}", param=param, code="invalid_value").body(),
                        status_code=400)


class CatchAll:
    """An exception no handler took becomes a 500 in OpenAI's shape and one log line (Starlette's
    own handler, outside it, would print a traceback to the server's stderr)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        started = {"yes": False}

        async def tracking_send(message) -> None:
            if message["type"] == "http.response.start":
                started["yes"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 (a bug: answered and logged, the server goes on)
            LOG.error("internal error on %s %s: %s: %s", scope.get("method"), scope.get("path"),
                      type(exc).__name__, exc)
            if scope["type"] == "http" and not started["yes"]:
                body = ApiError(500, f"internal error ({type(exc).__name__}); the server log has details",
                                kind="server_error", code="internal_error").body()
                await JSONResponse(body, status_code=500)(scope, receive, send)


# -- request bodies (dependencies) -------------------------------------------------------------------

async def parse(request: Request, model: type[BaseModel], state: ServeState):
    try:
        raw = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(raw, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        body = model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{param}: {message}", param=param, code="invalid_value") from None
    if body.model not in state.engine.slots:
        raise ApiError(404, f"the model `{body.model}` does not exist; GET /v1/models lists them",
                       param="model", code="model_not_found")
    request.state.model = body.model
    return body


async def chat_body(request: Request, state: ServeState = Depends(get_state)) -> ChatRequest:
    return await parse(request, ChatRequest, state)


async def completion_body(request: Request, state: ServeState = Depends(get_state)) -> CompletionRequest:
    return await parse(request, CompletionRequest, state)


# -- routes ------------------------------------------------------------------------------------------

def health(request: Request, state: ServeState = Depends(get_state)) -> dict:
    """Liveness for anyone; the served names and the load only for holders of the token."""
    if not getattr(request.state, "authenticated", True):
        return {"status": "ok"}
    return {"status": "ok", "models": list(state.engine.slots), "in_flight": state.admitted}


def list_models(state: ServeState = Depends(get_state)) -> dict:
    return {"object": "list", "data": [describe(s) for s in state.engine.slots.values()]}


def retrieve_model(model_id: str, state: ServeState = Depends(get_state)) -> dict:
    slot = state.engine.slots.get(model_id)
    if slot is None:
        raise ApiError(404, f"the model `{model_id}` does not exist; GET /v1/models lists them", param="model",
                       code="model_not_found")
    return describe(slot)


async def chat_completions(request: Request, body: ChatRequest = Depends(chat_body),
                           state: ServeState = Depends(get_state)):
    ids = state.engine.encode_chat([m.as_template() for m in body.messages])
    return await complete(request, state, body, ids, chat=True)


async def completions(request: Request, body: CompletionRequest = Depends(completion_body),
                      state: ServeState = Depends(get_state)):
    return await complete(request, state, body, state.engine.encode_text(body.prompt), chat=False)


# -- generation --------------------------------------------------------------------------------------

def budget(engine: Engine, body: Sampling, prompt_ids: list[int], param: str) -> int:
    room = engine.context_length - len(prompt_ids)
    if room <= 0:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; the model's context length is "
                       f"{engine.context_length}: shorten the prompt", param=param, code="context_length_exceeded")
    wanted = body.max_completion_tokens or body.max_tokens or min(256, room)
    if wanted > room:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens and max_tokens is {wanted}; the model's "
                       f"context length is {engine.context_length}: shorten the prompt or lower max_tokens",
                       param=param, code="context_length_exceeded")
    return wanted


def usage_of(ids: list[int], completion: int) -> dict:
    return {"prompt_tokens": len(ids), "completion_tokens": completion, "total_tokens": len(ids) + completion}


class Generation:
    """One admitted request, generated in its own thread, read piece by piece by the event loop.

    The thread owns the queue slot and the lease from ``start()`` on and gives both back in its
    ``finally``, whatever happens to the client (gone, never read the stream, timed out)."""

    def __init__(self, state: ServeState, body: Sampling, ids: list[int], max_tokens: int, record: dict):
        self.state, self.body, self.ids, self.max_tokens, self.record = state, body, ids, max_tokens, record
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.cancelled = threading.Event()
        self.stats: dict = {"completion_tokens": 0}  # written by the engine as it generates

    def start(self) -> "Generation":
        self.state.admit()
        try:
            threading.Thread(target=self._work, daemon=True, name="lodger-generate").start()
        except BaseException:
            self.state.leave()
            raise
        return self

    def _put(self, item) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is gone (server shutting down)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def _work(self) -> None:
        body = self.body
        try:
            # begin() counts the request in flight before anything that can fail: end() balances it
            self.record["held"] = self.state.lease.begin()
            penalties = Penalties(body.frequency_penalty, body.presence_penalty, body.repetition_penalty)
            generator = self.state.engine.generate(body.model, self.ids, max_tokens=self.max_tokens,
                                                   temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                                                   stop=body.stops(), penalties=penalties,
                                                   stats=self.stats)
            try:
                for piece in generator:
                    self._put(piece)
                    if self.cancelled.is_set():
                        break
            finally:
                generator.close()
        except Exception as exc:  # reported to the client; the server goes on
            LOG.error("generation failed for %s: %s: %s", body.model, type(exc).__name__, exc)
            self._put(exc)
        finally:
            try:
                self.state.lease.end()
            finally:
                self.state.leave()
                self._put(None)

    async def pieces(self):
        try:
            while (item := await self.queue.get()) is not None:
                if isinstance(item, Exception):
                    raise ApiError(500, f"generation failed: {item}", kind="server_error", code="generation_failed")
                yield item
        finally:
            self.cancelled.set()


async def complete(request: Request, state: ServeState, body: Sampling, ids: list[int], chat: bool):
    max_tokens = budget(state.engine, body, ids, "messages" if chat else "prompt")
    record = request.scope.setdefault("state", {})  # what the request's log line reports
    generation = Generation(state, body, ids, max_tokens, record).start()
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    if body.stream:
        return StreamingResponse(stream(generation, chat, ident, created),
                                 media_type="text/event-stream")
    text, finish, version = "", None, None
    async for piece, finish, version in generation.pieces():
        text += piece
    record["usage"] = usage = usage_of(ids, generation.stats["completion_tokens"])
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": body.model, "system_fingerprint": version, "choices": [choice], "usage": usage}


async def stream(generation: Generation, chat: bool, ident: str, created: int):
    body, with_usage = generation.body, generation.body.include_usage()
    kind = "chat.completion.chunk" if chat else "text_completion"
    version = None

    def chunk(choices: list, **extra) -> str:
        data = {"id": ident, "object": kind, "created": created, "model": body.model,
                "system_fingerprint": version, "choices": choices, **extra}
        if with_usage:
            data.setdefault("usage", None)  # as OpenAI: null on every chunk but the last
        return f"data: {json.dumps(data)}\n\n"

    def choice(text: str | None, finish: str | None, first: bool = False) -> dict:
        if not chat:
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}

    first = True
    try:
        async for piece, finish, version in generation.pieces():
            if first and chat:
                yield chunk([choice(None, None, first=True)])
            first = False
            if piece:
                yield chunk([choice(piece, None)])
            if finish:
                yield chunk([choice(None, finish)])
        generation.record["usage"] = usage = usage_of(generation.ids, generation.stats["completion_tokens"])
        if with_usage:
            yield chunk([], usage=usage)
    except ApiError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n"
    yield "data: [DONE]\n\n"


__all__ = ["ServeState", "create_app"]
