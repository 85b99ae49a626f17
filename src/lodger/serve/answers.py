"""The two generating endpoints, whole or streamed: chat (logprobs, response_format, tools) and text
completions (several prompts, echo, logprobs as the legacy API has them)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from .generation import Generation, Job, Outcome, add, budget, refuse_overlong, rules_of, usage_of
from .schema import ApiError, ChatRequest, CompletionRequest
from .shapes import chat_logprobs, completion_logprobs
from .structured import grammar_of
from .tools import offered, parse_calls


def ident(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


# -- chat ------------------------------------------------------------------------------------------

async def chat(request: Request, state, body: ChatRequest):
    engine = state.engine
    tools = offered(engine, body)
    grammar = grammar_of(body.response_format)
    if tools and grammar is not None:
        raise ApiError(400, "response_format: a JSON answer leaves no room for tool calls: send `tools` or a JSON "
                       "`response_format`, not both", param="response_format", code="unsupported_parameter")
    messages = [m.as_template() for m in body.messages]
    try:
        prompt_text = engine.chat_text(messages, tools)
    except Exception as exc:  # noqa: BLE001 (templates raise on conversations they do not take)
        raise ApiError(400, f"messages: the model's chat template refuses this conversation ({type(exc).__name__}: "
                       f"{exc})", param="messages", code="invalid_value") from None
    refuse_overlong(engine, prompt_text, "messages")
    ids = engine.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    job = Job(body.model, ids, budget(engine, body, ids, "messages"), rules_of(engine, body, body.report()),
              body.stops(), grammar)
    record = request.scope.setdefault("state", {})  # what the request's log line reports
    generation = Generation(state, job, record).start()
    head = {"id": ident("chatcmpl"), "created": int(time.time()), "model": body.model}
    if body.stream:
        return StreamingResponse(chat_stream(generation, body, head, tools, prompt_text),
                                 media_type="text/event-stream")
    outcome = await generation.collect()
    record["usage"] = usage = usage_of(len(ids), generation.stats["completion_tokens"])
    message, finish = chat_message(engine, outcome, tools, prompt_text)
    logprobs = chat_logprobs(outcome.tokens, engine.vocabulary) if body.logprobs else None
    return {**head, "object": "chat.completion", "system_fingerprint": outcome.version, "usage": usage,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}]}


def chat_message(engine, outcome: Outcome, tools, prompt_text: str) -> tuple[dict, str | None]:
    """The assistant message and finish reason; with tools, the calls parsed out of the text."""
    message: dict[str, Any] = {"role": "assistant", "content": outcome.text}
    if tools:
        content, calls = parse_calls(engine, outcome.text, prompt_text, tools)
        if calls:
            message.update(content=content, tool_calls=calls)
            return message, "tool_calls"
    return message, outcome.finish


async def chat_stream(generation: Generation, body: ChatRequest, head: dict, tools, prompt_text: str):
    """Chunks as OpenAI sends them; with tools the answer is read whole first (its calls are known only
    then) and sent as one content delta and one tool_calls delta."""
    engine, with_usage, version = generation.state.engine, body.include_usage(), None

    def chunk(choices: list, **extra) -> str:
        data = {**head, "object": "chat.completion.chunk", "system_fingerprint": version, "choices": choices,
                **extra}
        if with_usage:
            data.setdefault("usage", None)  # as OpenAI: null on every chunk but the last
        return sse(data)

    def choice(delta: dict, finish: str | None = None, tokens=None) -> dict:
        logprobs = chat_logprobs(tokens, engine.vocabulary) if body.logprobs and tokens is not None else None
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}

    first = True
    try:
        outcome = Outcome()
        async for piece in generation.pieces():
            version = piece.version
            if first:
                yield chunk([choice({"role": "assistant", "content": ""})])
                first = False
            if tools:
                add(outcome, piece)
                continue
            if piece.text or piece.tokens:
                yield chunk([choice({"content": piece.text}, tokens=piece.tokens)])
            if piece.finish:
                yield chunk([choice({}, piece.finish)])
        if tools:
            message, finish = chat_message(engine, outcome, tools, prompt_text)
            if message["content"]:
                yield chunk([choice({"content": message["content"]}, tokens=outcome.tokens)])
            if "tool_calls" in message:
                calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
                yield chunk([choice({"tool_calls": calls})])
            yield chunk([choice({}, finish)])
        generation.record["usage"] = usage = usage_of(len(generation.job.ids), generation.stats["completion_tokens"])
        if with_usage:
            yield chunk([], usage=usage)
    except ApiError as exc:
        yield sse(exc.body())
    yield "data: [DONE]\n\n"


# -- text completions ------------------------------------------------------------------------------

def completion_jobs(engine, body: CompletionRequest) -> list[tuple[Job, str]]:
    """(job, prompt text) per prompt, every prompt checked before any is generated."""
    prompts = body.prompts()
    if body.stream and len(prompts) > 1:
        raise ApiError(400, "prompt: stream one prompt at a time (or send several without `stream`)",
                       param="prompt", code="unsupported_parameter")
    jobs = []
    for prompt in prompts:
        if isinstance(prompt, list) and any(not 0 <= t < engine.vocab for t in prompt):
            raise ApiError(400, f"prompt: token ids are 0 to {engine.vocab - 1}", param="prompt", code="invalid_value")
        if isinstance(prompt, str):
            refuse_overlong(engine, prompt, "prompt")
        ids, text, offsets = engine.encode_prompt(prompt)
        if not ids:
            raise ApiError(400, "prompt: it encodes to no tokens", param="prompt", code="invalid_value")
        echo = offsets if body.echo and body.logprobs is not None else None
        jobs.append((Job(body.model, ids, budget(engine, body, ids, "prompt"), rules_of(engine, body, body.logprobs),
                         body.stops(), echo=echo), text))
    return jobs


async def completions(request: Request, state, body: CompletionRequest):
    engine = state.engine
    jobs = completion_jobs(engine, body)
    record = request.scope.setdefault("state", {})
    head = {"id": ident("cmpl"), "object": "text_completion", "created": int(time.time()), "model": body.model}
    if body.stream:
        job, text = jobs[0]
        return StreamingResponse(completion_stream(Generation(state, job, record).start(), body, head, text),
                                 media_type="text/event-stream")
    choices, prompt_tokens, completion_tokens, version = [], 0, 0, None
    for index, (job, text) in enumerate(jobs):  # one after another: each holds the engine while it runs
        generation = Generation(state, job, record).start()
        outcome = await generation.collect()
        version = outcome.version
        prompt_tokens += len(job.ids)
        completion_tokens += generation.stats["completion_tokens"]
        shown = text if body.echo else ""
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs([(outcome.prompt, 0), (outcome.tokens, len(shown))], engine.vocabulary)
        choices.append({"index": index, "text": shown + outcome.text, "finish_reason": outcome.finish,
                        "logprobs": logprobs})
    record["usage"] = usage = usage_of(prompt_tokens, completion_tokens)
    return {**head, "system_fingerprint": version, "choices": choices, "usage": usage}


async def completion_stream(generation: Generation, body: CompletionRequest, head: dict, prompt_text: str):
    engine, with_usage, version = generation.state.engine, body.include_usage(), None
    shown = prompt_text if body.echo else ""

    def chunk(text: str, finish: str | None, tokens, base: int) -> str:
        logprobs = completion_logprobs([(tokens, base)], engine.vocabulary) if body.logprobs is not None else None
        data = {**head, "system_fingerprint": version,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}]}
        if with_usage:
            data["usage"] = None
        return sse(data)

    try:
        echoed = False
        async for piece in generation.pieces():
            version = piece.version
            if body.echo and not echoed:  # the prompt first, as OpenAI streams an echo
                echoed = True
                yield chunk(prompt_text, None, piece.tokens if piece.prompt else [], 0)
                if piece.prompt:
                    continue
            yield chunk(piece.text, piece.finish, piece.tokens, len(shown))
        generation.record["usage"] = usage = usage_of(len(generation.job.ids), generation.stats["completion_tokens"])
        if with_usage:
            yield sse({**head, "system_fingerprint": version, "choices": [], "usage": usage})
    except ApiError as exc:
        yield sse(exc.body())
    yield "data: [DONE]\n\n"


__all__ = ["chat", "completions"]
