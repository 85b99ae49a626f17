"""The HTTP app: OpenAI-compatible chat and text completions, models, health.

Every error has OpenAI's shape ({"error": {"message", "type", "param", "code"}}), whatever raised it
(our checks, an unknown route, a wrong method, a bug); the server keeps serving. A request body is
checked whole before anything is generated: an unknown field, a refused one or a bad value is a 400
naming it (schema.py). Requests beyond ``max_queue`` (in flight plus waiting) get 429. Each admitted
request is generated in a thread of its own (generation.py); answers.py shapes the answers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from . import answers
from .auth import Guard, GuardMiddleware
from .engine import Engine, describe
from .lease import InferenceLease
from .schema import REFUSED_CHAT, REFUSED_COMPLETION, ApiError, ChatRequest, CompletionRequest, refusal

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
        # the tokenizer as llguidance reads it (about a second), before a request needs it
        threading.Thread(target=warm_vocabulary, args=(engine,), daemon=True, name="lodger-vocabulary").start()
        yield
        state.stop_reload.set()
        state.lease.close()

    app = FastAPI(title="lodger", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.serve = state
    # Starlette types every handler as taking any Exception; each of these is registered for its own class.
    app.add_exception_handler(ApiError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id}", retrieve_model, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_middleware(CatchAll)
    if guard is not None:  # outermost: refuses before anything runs, and logs what CatchAll answered
        app.add_middleware(GuardMiddleware, guard=guard)
    return app


def warm_vocabulary(engine: Engine) -> None:
    try:
        engine.vocabulary  # noqa: B018 (a cached property: built here once)
    except Exception as exc:  # noqa: BLE001 (only logprobs, response_format and token-id prompts need it)
        LOG.warning("llguidance cannot read this tokenizer (%s: %s): logprobs, response_format and token-id "
                    "prompts will fail", type(exc).__name__, exc)


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

REFUSED = {ChatRequest: REFUSED_CHAT, CompletionRequest: REFUSED_COMPLETION}
Body = TypeVar("Body", ChatRequest, CompletionRequest)


async def parse(request: Request, model: type[Body], state: ServeState) -> Body:
    try:
        raw = await request.json()
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past Python's stack
        raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(raw, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    refused = refusal(raw, REFUSED[model])
    if refused is not None:
        raise refused
    try:
        body = model.model_validate(raw)
    except ValidationError as exc:
        raise invalid(exc) from None
    body.check()
    if body.model not in state.engine.slots:
        raise ApiError(404, f"the model `{body.model}` does not exist; GET /v1/models lists them",
                       param="model", code="model_not_found")
    request.state.model = body.model
    return body


def invalid(exc: ValidationError) -> ApiError:
    """The first problem of a body as a 400 naming its field (an unknown field by its name)."""
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param} (docs/serve.md lists the "
                        "parameters this server supports, refuses and ignores)", param=param,
                        code="unknown_parameter")
    message = first["msg"].removeprefix("Value error, ")
    return ApiError(400, f"{param}: {message}", param=param or None, code="invalid_value")


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
    return await answers.chat(request, state, body)


async def completions(request: Request, body: CompletionRequest = Depends(completion_body),
                      state: ServeState = Depends(get_state)):
    return await answers.completions(request, state, body)


__all__ = ["ServeState", "create_app"]
