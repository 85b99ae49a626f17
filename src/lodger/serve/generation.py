"""One admitted request generated in a thread of its own, and read piece by piece by the event loop.

The thread owns the request's queue slot and inference lease from ``start()`` on and gives both back
in its ``finally``, whatever happens to the client (gone, never read the stream, timed out).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass, field

from .decode import Penalties, Piece, Rules, TokenInfo
from .schema import ApiError, Sampling

LOG = logging.getLogger("lodger.serve")


@dataclass
class Job:
    """What one generation does: a slot's answer to ``ids`` under ``rules``. ``grammar``: an llguidance
    grammar the answer must follow; ``echo``: where each prompt token's text starts, when the prompt's
    tokens are reported too."""

    model: str
    ids: list[int]
    max_tokens: int
    rules: Rules
    stop: list[str]
    grammar: str | None = None
    echo: list[int] | None = None


@dataclass
class Outcome:
    """A whole answer: its text, finish reason, adapter version, and the tokens reported."""

    text: str = ""
    finish: str | None = None
    version: str | None = None
    tokens: list[TokenInfo] = field(default_factory=list)
    prompt: list[TokenInfo] = field(default_factory=list)


def refuse_overlong(engine, text: str, param: str) -> None:
    """A 400 for a text that holds more tokens than the context at the least, before it is tokenised:
    tokenising costs memory by the character (hundreds of bytes each), not by what fits."""
    fewest = len(text.encode("utf-8", "replace")) // engine.token_bytes_bound
    if fewest > engine.context_length:
        raise ApiError(400, f"the prompt has at least {fewest} tokens; the model's context length is "
                       f"{engine.context_length}: shorten the prompt", param=param, code="context_length_exceeded")


def budget(engine, body: Sampling, prompt_ids: list[int], param: str) -> int:
    room = engine.context_length - len(prompt_ids)
    wanted = body.budget()
    if wanted is None:
        wanted = min(256, room)
    if room <= 0 and wanted:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; the model's context length is "
                       f"{engine.context_length}: shorten the prompt", param=param, code="context_length_exceeded")
    if wanted > room:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens and max_tokens is {wanted}; the model's "
                       f"context length is {engine.context_length}: shorten the prompt or lower max_tokens",
                       param=param, code="context_length_exceeded")
    return wanted


def rules_of(engine, body: Sampling, report: int | None) -> Rules:
    """The sampling rules of a request; ApiError 400 for a logit_bias key outside the vocabulary."""
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if int(key) >= engine.vocab:
            raise ApiError(400, f"logit_bias: token id {key} is outside the vocabulary (0 to {engine.vocab - 1})",
                           param="logit_bias", code="invalid_value")
        bias[int(key)] = value
    return Rules(temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                 penalties=Penalties(body.frequency_penalty, body.presence_penalty, body.repetition_penalty),
                 bias=bias, report=report)


def usage_of(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Generation:
    """One job in its own thread; the event loop reads its pieces."""

    def __init__(self, state, job: Job, record: dict):
        self.state, self.job, self.record = state, job, record
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
        job, engine = self.job, self.state.engine
        try:
            # begin() counts the request in flight before anything that can fail: end() balances it
            self.record["held"] = self.state.lease.begin()
            if job.grammar is not None:
                from .structured import GrammarConstraint

                job.rules.constraint = GrammarConstraint(engine.vocabulary, job.grammar)
            elif job.rules.report is not None:
                engine.vocabulary  # noqa: B018 (built here, once, not in the event loop when answering)
            generator = engine.stream(job.model, job.ids, max_tokens=job.max_tokens, rules=job.rules,
                                      stop=job.stop, stats=self.stats, echo=job.echo)
            try:
                for piece in generator:
                    self._put(piece)
                    if self.cancelled.is_set():
                        break
            finally:
                generator.close()
        except ApiError as exc:
            self._put(exc)
        except Exception as exc:  # reported to the client; the server goes on
            LOG.error("generation failed for %s: %s: %s", job.model, type(exc).__name__, exc)
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
                if isinstance(item, ApiError):  # the request's own fault, found once generating
                    raise item
                if isinstance(item, Exception):
                    raise ApiError(500, f"generation failed: {item}", kind="server_error", code="generation_failed")
                yield item
        finally:
            self.cancelled.set()

    async def collect(self) -> Outcome:
        outcome = Outcome()
        async for piece in self.pieces():
            add(outcome, piece)
        return outcome


def add(outcome: Outcome, piece: Piece) -> None:
    if piece.prompt:
        outcome.prompt += piece.tokens
    else:
        outcome.text += piece.text
        outcome.tokens += piece.tokens
    outcome.finish = piece.finish or outcome.finish
    outcome.version = piece.version


__all__ = ["Generation", "Job", "Outcome", "budget", "rules_of", "usage_of"]
