"""The rewards people need without writing code, each a function with TRL's reward signature
(``prompts, completions, completion_ids, **fields`` -> one float per completion), made from its
[[rewards]] table by ``make``."""

from __future__ import annotations

import re
from typing import Any, Callable

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def text_of(completion: Any) -> str:
    """A completion's text: plain text as it is, a conversational one's assistant content."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def last_number(text: str) -> float | None:
    """The last number written in ``text`` ("1,234.5" counts as 1234.5), or None."""
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def answer_reward(extract: str, pattern: str | None, field: str) -> Callable:
    compiled = re.compile(pattern, re.DOTALL) if pattern else None

    def answer(prompts, completions, completion_ids=None, **fields) -> list[float | None]:
        truths = fields.get(field)
        if truths is None:
            raise KeyError(f'the data lines have no "{field}" field for the answer reward to compare with')
        out: list[float | None] = []
        for completion, truth in zip(completions, truths):
            if truth is None:
                out.append(None)  # this line has no answer: the reward does not apply (TRL's None)
                continue
            text = text_of(completion)
            if extract == "last_number":
                got, want = last_number(text), last_number(str(truth))
                out.append(float(got is not None and want is not None and abs(got - want) <= 1e-6 * max(1, abs(want))))
            else:
                assert compiled is not None
                match = compiled.search(text)
                out.append(float(match is not None and match.group(1).strip() == str(truth).strip()))
        return out

    return answer


def format_reward(pattern: str) -> Callable:
    compiled = re.compile(pattern, re.DOTALL)

    def format(prompts, completions, completion_ids=None, **fields) -> list[float]:  # noqa: A001 (the kind's name)
        return [float(compiled.fullmatch(text_of(c).strip()) is not None) for c in completions]

    return format


def length_reward(target: int, limit: int) -> Callable:
    span = max(limit - target, 1)

    def length(prompts, completions, completion_ids=None, **fields) -> list[float]:
        return [-min(max(len(ids) - target, 0) / span, 1.0) for ids in completion_ids]

    return length


def code_of(text: str) -> str:
    """The program in a completion: its last fenced Python block, or the whole text."""
    blocks = CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else text


def code_reward(field: str, timeout: float, memory_mb: int, processes: int) -> Callable:
    from .sandbox import run_python

    def code(prompts, completions, completion_ids=None, **fields) -> list[float | None]:
        tests = fields.get(field)
        if tests is None:
            raise KeyError(f'the data lines have no "{field}" field with the tests to run')
        out: list[float | None] = []
        for completion, test in zip(completions, tests):
            if test is None:
                out.append(None)
                continue
            program = code_of(text_of(completion)) + "\n\n" + str(test) + "\n"
            result = run_python(program, timeout=timeout, memory_mb=memory_mb, processes=processes)
            out.append(1.0 if result.ok else 0.0)  # code that fails or runs too long is a wrong answer
        return out

    return code


def make(spec: dict) -> Callable:
    """The built-in reward function of a [[rewards]] table (as ``rewards.spec_of`` sends it)."""
    kind = spec["kind"]
    if kind == "answer":
        return answer_reward(spec["extract"], spec.get("pattern"), spec.get("field") or "answer")
    if kind == "format":
        return format_reward(spec["pattern"])
    if kind == "length":
        return length_reward(spec["target"], spec["max_completion_length"])
    if kind == "code":
        return code_reward(spec.get("field") or "tests", spec["timeout_seconds"], spec["memory_mb"], spec["processes"])
    raise ValueError(f"not a built-in reward: {kind!r}")
