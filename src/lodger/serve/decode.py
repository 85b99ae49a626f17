"""Choosing each next token of one request: the sampling rules, penalties, logit bias, a grammar's
mask, and what the answer reports about each token (its log-probability and the likeliest others).

No model and no HTTP here: the engine hands in each step's logits and gets a token back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class TokenInfo:
    """One token as the answer's `logprobs` report it. ``logprob`` is the model's own distribution at
    that position (before temperature, penalties, bias or a grammar's mask: what vLLM reports by
    default, and what a log-likelihood evaluation needs); None for a prompt's first token, which has
    no context. ``top`` is the likeliest tokens there, most likely first, as (token id, logprob).
    ``offset`` is where the token's text starts in the text it belongs to (prompt or completion)."""

    id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()
    offset: int = 0


@dataclass
class Piece:
    """What the engine yields: new text, the finish reason on the last piece, the adapter version that
    produced it, and the tokens whose text starts in this piece (when ``Rules.report`` is set)."""

    text: str
    finish: str | None
    version: str
    tokens: list[TokenInfo] = field(default_factory=list)
    prompt: bool = False  # the prompt's own tokens (echo), before any answer


class Constraint(Protocol):
    """A grammar that says which tokens may come next (response_format); see structured.py."""

    def allowed(self, vocab: int): ...      # a bool tensor of the logits' length
    def advance(self, token: int) -> None: ...


@dataclass(frozen=True)
class Penalties:
    """OpenAI's frequency and presence penalties (on the answer's tokens so far) and the
    `repetition_penalty` extension (Hugging Face's: on every token of the prompt and the answer)."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0

    @property
    def active(self) -> bool:
        return bool(self.frequency or self.presence or self.repetition != 1.0)

    def history(self, prompt_ids: list[int], vocab: int) -> "TokenHistory":
        return TokenHistory(prompt_ids, vocab, self.active)

    def apply(self, logits, history: "TokenHistory"):
        """The logits with the penalties taken off (a new tensor; unchanged when none is set)."""
        if not self.active:
            return logits
        logits = logits.clone()
        if self.repetition != 1.0:
            seen = history.seen
            scaled = logits.where(logits < 0, logits / self.repetition)
            scaled = scaled.where(logits >= 0, logits * self.repetition)
            logits = logits.where(~seen, scaled)
        counts = history.counts
        return logits - counts * self.frequency - (counts > 0).float() * self.presence


class TokenHistory:
    """Which tokens the prompt and the answer hold (for repetition), and how often the answer has each."""

    def __init__(self, prompt_ids: list[int], vocab: int, needed: bool):
        import torch

        size = vocab if needed else 0  # the logits' length
        self.counts = torch.zeros(size)
        self.seen = torch.zeros(size, dtype=torch.bool)
        if needed and prompt_ids:
            self.seen[torch.tensor(prompt_ids)] = True

    def add(self, token: int) -> None:
        if token < self.counts.shape[0]:
            self.counts[token] += 1
            self.seen[token] = True


@dataclass
class Rules:
    """How one request chooses its tokens. ``report``: None reports nothing; N >= 0 reports each
    chosen token's logprob and the N likeliest tokens at its position."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    penalties: Penalties = field(default_factory=Penalties)
    bias: dict[int, float] = field(default_factory=dict)
    constraint: Constraint | None = None
    report: int | None = None

    def generator(self):
        import torch

        generator = torch.Generator()
        if self.seed is not None:
            generator.manual_seed(self.seed)
        else:
            generator.seed()  # unseeded requests get fresh randomness
        return generator

    def choose(self, logits, history: TokenHistory, generator) -> tuple[int, TokenInfo | None]:
        """The next token from one position's raw logits, and what is reported about it."""
        shaped = self.penalties.apply(logits, history)
        if self.bias:
            shaped = shaped.clone() if shaped is logits else shaped
            for token, value in self.bias.items():
                if token < shaped.shape[0]:
                    shaped[token] += value
        if self.constraint is not None:
            allowed = self.constraint.allowed(shaped.shape[0])
            shaped = shaped.masked_fill(~allowed, float("-inf"))
        token = sample(shaped, self.temperature, self.top_p, generator)
        if self.constraint is not None:
            self.constraint.advance(token)
        return token, (None if self.report is None else report(logits, token, self.report))


def report(logits, token: int, top: int, offset: int = 0) -> TokenInfo:
    """``token``'s logprob under ``logits`` (one position) and the ``top`` likeliest, from one
    log-softmax, so a token that is the likeliest reports exactly the top value."""
    import torch

    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[0]))
        best = tuple(zip(ids.tolist(), values.tolist()))
    return TokenInfo(token, float(logprobs[token]), best, offset)


def prompt_report(logits, targets: list[int], top: int, offsets: list[int]) -> list[TokenInfo]:
    """Each of ``targets``' logprob (and the ``top`` likeliest) under the logits of the positions
    before them ([len(targets), vocab], one row per target), all from one log-softmax per row."""
    import torch

    rows = torch.log_softmax(logits.float(), dim=-1)
    chosen = rows.gather(1, torch.tensor(targets)[:, None])[:, 0].tolist()
    best = torch.topk(rows, min(top, rows.shape[1])) if top else None
    infos = []
    for i, value in enumerate(chosen):
        pairs = tuple(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else ()
        infos.append(TokenInfo(targets[i], value, pairs, offsets[i]))
    return infos


def sample(logits, temperature: float, top_p: float, generator) -> int:
    import torch

    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator))


__all__ = ["Constraint", "Penalties", "Piece", "Rules", "TokenHistory", "TokenInfo", "prompt_report", "report",
           "sample"]
