"""Structured output: `response_format` compiled to a grammar by llguidance, whose mask of allowed
tokens is applied at every step, and each token's own bytes (for `logprobs`).

llguidance (Microsoft's guidance-ai; the Rust core behind vLLM's, SGLang's and llama.cpp's structured
output) reads the Hugging Face tokenizer itself, compiles a JSON schema lazily (nothing is computed per
vocabulary up front) and computes each step's mask on the CPU in microseconds. A schema it cannot
compile is refused before generation with the compiler's own message.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from .schema import ApiError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # the stub names it; the package does not re-export it

#: OpenAI's JSON mode answers any JSON object; compact separators and no free whitespace keep a small
#: model from spending its tokens on blanks (a known way for constrained small models to loop).
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class Vocabulary:
    """The engine's tokenizer as llguidance reads it: built once (about a second for a 49k vocabulary)."""

    def __init__(self, tokenizer, vocab: int):
        import llguidance.hf

        self.size = vocab
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    def token_bytes(self, token: int) -> bytes:
        return self.tokenizer.decode_bytes([token])


def grammar_of(response_format) -> str | None:
    """The llguidance grammar of a `response_format` (schema.ResponseFormat), None for plain text;
    ApiError 400 naming the field for a schema that does not compile."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return compile_schema({"type": "object"}, "response_format")
    return compile_schema(response_format.json_schema.schema_ or {}, "response_format.json_schema.schema")


def compile_schema(schema: dict, where: str) -> str:
    """A JSON schema as an llguidance grammar; ApiError 400 naming ``where`` when it does not compile
    (an unknown type, a dangling $ref, a bad pattern, a keyword llguidance does not implement)."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
        problem = llguidance.LLMatcher.validate_grammar(grammar)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 (a Rust panic is a BaseException; the server goes on)
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        raise ApiError(400, f"{where}: the JSON schema cannot be compiled to a grammar: {problem.strip()}",
                       param=where, code="invalid_json_schema")
    return grammar


class GrammarConstraint:
    """One request's llguidance matcher: the tokens allowed next, advanced by each chosen token."""

    def __init__(self, vocabulary: Vocabulary, grammar: str):
        import llguidance

        self.vocabulary = vocabulary
        self.matcher = llguidance.LLMatcher(vocabulary.tokenizer, grammar, log_level=0)
        if self.matcher.is_error():  # past a limit of llguidance's that only the tokenizer shows
            raise ApiError(400, f"response_format: the schema cannot be used: {self.matcher.get_error()}",
                           param="response_format", code="invalid_json_schema")

    def _check(self) -> None:
        if self.matcher.is_error():
            raise RuntimeError(f"the grammar failed: {self.matcher.get_error()}")

    def allowed(self, vocab: int):
        import numpy as np
        import torch

        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        self._check()
        mask = np.unpackbits(bits, bitorder="little")[:vocab].astype(bool)
        if mask.shape[0] < vocab:  # logits beyond the tokenizer's vocabulary are never allowed
            mask = np.concatenate([mask, np.zeros(vocab - mask.shape[0], dtype=bool)])
        return torch.from_numpy(mask)

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            self._check()
            raise RuntimeError(f"the grammar refused token {token}")


__all__ = ["GrammarConstraint", "JSON_OPTIONS", "Vocabulary", "compile_schema", "grammar_of"]
