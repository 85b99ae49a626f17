"""The HTTP app: OpenAI-compatible chat and text completions, models, health.

Every error has OpenAI's shape ({"error": {"message", "type", "param", "code"}}) and a 4xx status;
the server keeps serving. Requests beyond ``max_queue`` (in flight plus waiting) get 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .engine import Engine, describe
from .lease import InferenceLease


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=1)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Sampling):
    prompt: str


def create_app(engine: Engine, *, token: str | None = None, max_queue: int = 8, lease: InferenceLease | None = None,
               reload_seconds: float = 0.5) -> FastAPI:
    lease = lease or InferenceLease(enabled=False)
    stop_reload = threading.Event()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        stop_reload.set()
        lease.close()

    app = FastAPI(title="lodger", docs_url=None, redoc_url=None, lifespan=lifespan)
    admitted = {"count": 0}
    admit_lock = threading.Lock()

    def reload_loop() -> None:
        while not stop_reload.wait(reload_seconds):
            engine.refresh_all()

    threading.Thread(target=reload_loop, daemon=True).start()

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if token and request.headers.get("authorization") != f"Bearer {token}":
            return ApiError(401, "missing or wrong API token (Authorization: Bearer ...)", code="invalid_api_key",
                            kind="authentication_error").response()
        return await call_next(request)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "models": [s.version for s in engine.slots.values()],
                "in_flight": admitted["count"]}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [describe(s) for s in engine.slots.values()]}

    async def parse(request: Request, model: type[BaseModel]):
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
            raise ApiError(400, f"{param}: {first['msg']}", param=param, code="invalid_value") from None
        if body.model not in engine.slots:
            raise ApiError(404, f"the model `{body.model}` does not exist; GET /v1/models lists them",
                           param="model", code="model_not_found")
        return body

    def budget(body: _Sampling, prompt_ids: list[int], param: str) -> int:
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

    def admit() -> None:
        with admit_lock:
            if admitted["count"] >= max_queue:
                raise ApiError(429, f"too many requests: {max_queue} in flight or waiting; retry shortly",
                               code="rate_limit_exceeded", kind="rate_limit_error")
            admitted["count"] += 1

    def leave() -> None:
        with admit_lock:
            admitted["count"] -= 1

    async def pieces(body: _Sampling, ids: list[int], max_tokens: int):
        """Run the generation in its own thread (it holds the engine lock) and hand pieces over."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])

        def work() -> None:
            lease.begin()
            try:
                generator = engine.generate(body.model, ids, max_tokens=max_tokens, temperature=body.temperature,
                                            top_p=body.top_p, seed=body.seed, stop=stop)
                for piece in generator:
                    loop.call_soon_threadsafe(queue.put_nowait, piece)
                    if cancelled.is_set():
                        generator.close()
                        break
            except Exception as exc:  # reported to the client; the server goes on
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                lease.end()
                leave()
                loop.call_soon_threadsafe(queue.put_nowait, None)

        threading.Thread(target=work, daemon=True).start()
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise ApiError(500, f"generation failed: {item}", kind="server_error")
                yield item
        finally:
            cancelled.set()

    async def complete(body: _Sampling, ids: list[int], chat: bool):
        max_tokens = budget(body, ids, "messages" if chat else "prompt")
        admit()
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.stream:
            return StreamingResponse(stream(body, ids, max_tokens, chat, ident, created), media_type="text/event-stream")
        text, finish, version = "", None, None
        async for piece, finish, version in pieces(body, ids, max_tokens):
            text += piece
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(engine.tokenizer(text, add_special_tokens=False)
                                                                         ["input_ids"]) if text else 0}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": body.model, "system_fingerprint": version, "choices": [choice], "usage": usage}

    async def stream(body, ids, max_tokens, chat, ident, created):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta_text: str | None, finish: str | None, version: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": delta_text} if delta_text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
            body_ = {"id": ident, "object": kind, "created": created, "model": body.model,
                     "system_fingerprint": version, "choices": [choice]}
            return f"data: {json.dumps(body_)}\n\n"

        first = True
        try:
            async for piece, finish, version in pieces(body, ids, max_tokens):
                if first:
                    if chat:
                        yield chunk(None, None, version, first=True)
                    first = False
                if piece:
                    yield chunk(piece, None, version)
                if finish:
                    yield chunk(None, finish, version)
        except ApiError as exc:
            yield f"data: {json.dumps({'error': {'message': exc.message, 'type': exc.kind}})}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatRequest)
        ids = engine.encode_chat([m.model_dump() for m in body.messages])
        return await complete(body, ids, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        return await complete(body, engine.encode_text(body.prompt), chat=False)

    return app
