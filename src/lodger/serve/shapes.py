"""`logprobs` in OpenAI's two shapes, from the tokens the engine reports (decode.TokenInfo).

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
  "refusal": null}``, the top list exactly ``top_logprobs`` long;
- completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one entry per token,
  each top entry a {token: logprob} dict of the ``logprobs`` likeliest and the chosen token (so up to
  logprobs + 1, as OpenAI documents); with `echo` the prompt's tokens come first, the first of them
  with null (it has no context). This is what lm-eval's `local-completions` reads.

A token that is part of a character (byte-level tokens) is named ``bytes:\\xNN...`` as OpenAI does.
"""

from __future__ import annotations

from .decode import TokenInfo


def token_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class Namer:
    """Token ids to their text and bytes, each looked up once per answer."""

    def __init__(self, vocabulary):
        self.vocabulary, self.seen = vocabulary, {}

    def __call__(self, token: int) -> tuple[str, bytes]:
        if token not in self.seen:
            raw = self.vocabulary.token_bytes(token)
            self.seen[token] = (token_text(raw), raw)
        return self.seen[token]


def chat_logprobs(tokens: list[TokenInfo], vocabulary) -> dict:
    name = Namer(vocabulary)

    def entry(token: int, logprob: float | None) -> dict:
        text, raw = name(token)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                        for t in tokens], "refusal": None}


def completion_logprobs(segments: list[tuple[list[TokenInfo], int]], vocabulary) -> dict:
    """``segments``: (tokens, where their text starts in the choice's text): the echoed prompt's at 0,
    the completion's after it."""
    name = Namer(vocabulary)
    shape: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tokens, base in segments:
        for t in tokens:
            best = None
            if t.logprob is not None:
                best = {name(i)[0]: lp for i, lp in t.top}
                best.setdefault(name(t.id)[0], t.logprob)
            shape["tokens"].append(name(t.id)[0])
            shape["token_logprobs"].append(t.logprob)
            shape["top_logprobs"].append(best)
            shape["text_offset"].append(base + t.offset)
    return shape


__all__ = ["chat_logprobs", "completion_logprobs", "token_text"]
