"""Prompt-only data for GRPO: lines `{"prompt": ...}` with any other fields (`answer`, `tests`, ...)
handed to the reward functions, validated like SFT data, tokenised as TRL 1.16 does, cached by
content.

Shapes (TRL's own): `prompt` is a non-empty string, used as it is (plain text: the completion
continues it), or a non-empty list of messages, rendered with the chat template and its
generation prompt (conversational: the completion is the assistant's reply, and reward functions
get it as `[{"role": "assistant", "content": ...}]`). The other fields of a line go to the reward
functions unchanged, one entry per completion (TRL's dataset columns). A prompt longer than
[data] max_length tokens is refused with its line number, as preference data is (TRL cuts it from
the left without a word, so the model would answer a question it never saw whole).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

from .. import durable
from .chats import ROLES, DataFile, text_problem
from ..errors import DataError
from .preference import messages_problem
from ..home import cache_dir

FORMAT_VERSION = 1
RESERVED = ("prompts", "completions", "completion_ids", "step", "line")  # names the reward call uses itself


def check_row(row: object) -> str | None:
    """Why a parsed line is not a prompt line (data.read_jsonl's ``check``), or None."""
    if not isinstance(row, dict):
        return "expected a JSON object"
    if "prompt" not in row:
        if "messages" in row or "text" in row:
            return ('a supervised line ("messages"/"text"); objective = "grpo" needs "prompt" (and the fields your '
                    "rewards read)")
        return 'missing "prompt" (objective = "grpo" needs {"prompt": ..., plus the fields your rewards read})'
    taken = [key for key in RESERVED if key in row and key != "line"]
    if taken:
        return f'"{taken[0]}" is a name the reward call uses itself; rename that field'
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return text_problem(prompt, '"prompt"') if prompt.strip() else '"prompt" is empty'
    why = messages_problem(prompt, "prompt", ROLES)
    if why:
        return why
    if prompt[-1]["role"] == "assistant":
        return ("the prompt's last message is the assistant's: the completion is the next assistant turn; end with "
                "a user message")
    return None


def encode_prompt(tokenizer, prompt: Any) -> list[int]:
    """The prompt's token ids, as TRL tokenises it (plain text as it is; messages through the chat
    template with the generation prompt)."""
    if isinstance(prompt, str):
        return list(tokenizer(text=prompt)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("message lists need the tokenizer's chat template, and the model of [model] source has "
                        "none; write the prompt as a string, or use a model with a chat template")
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              add_generation_prompt=True)["input_ids"])


def tokenize_prompts(data: DataFile, tokenizer, tokenizer_sha: str, max_length: int) -> "PromptSet":
    """Tokenise a validated prompt file (one DataError for every prompt over max_length), reusing
    the cache keyed by content, tokenizer and max length."""
    import torch
    from safetensors.torch import load_file, save

    key = hashlib.sha256(f"prompts{FORMAT_VERSION}|{data.sha256}|{tokenizer_sha}|{max_length}".encode()).hexdigest()
    cached = cache_dir("tokens") / f"{key[:32]}.safetensors"
    if cached.is_file():
        try:
            return PromptSet(load_file(str(cached)), data.rows)
        except Exception:  # a damaged cache is rebuilt, never trusted
            cached.unlink(missing_ok=True)
    ids: list[int] = []
    offsets, long = [0], []
    for row in data.rows:
        try:
            encoded = encode_prompt(tokenizer, row["prompt"])
        except DataError as exc:
            raise DataError(f"{data.path}:{row['line']}: {exc}") from None
        if len(encoded) > max_length:
            long.append((row["line"], len(encoded)))
        ids += encoded
        offsets.append(len(ids))
    if long:
        shown = ", ".join(f"{line} ({n} tokens)" for line, n in long[:10]) + (
            f" and {len(long) - 10} more" if len(long) > 10 else "")
        raise DataError(f"{data.path}: {len(long)} of {len(data.rows)} prompt(s) are longer than [data] max_length "
                        f"= {max_length} tokens (lines {shown}); raise max_length (the prompt limit for objective "
                        "= \"grpo\") or shorten those prompts")
    tensors = {"ids": torch.tensor(ids, dtype=torch.int64), "offsets": torch.tensor(offsets, dtype=torch.int64),
               "lines": torch.tensor([r["line"] for r in data.rows], dtype=torch.int64)}
    durable.atomic_write(cached, save(tensors))
    return PromptSet(tensors, data.rows)


@dataclass
class PromptBatch:
    """A micro-batch of prompts before sampling: their dataset indices (GRPO's prepare turns them
    into completions, train/grpo.py). Counts as the loop's batches do: nothing computed yet."""

    prompt_indices: list[int]
    target_tokens: int = 0
    tokens: int = 0
    positions: int = 0
    attended: int = 0


class PromptSet:
    """Prompts stored flat (ids, offsets; safetensors, no pickle) with their lines' rows, whose
    other fields the rewards read. ``prompts`` marks it for the planner and the objective."""

    prompts = True

    def __init__(self, tensors: dict, rows: list[dict]):
        self.ids, self.offsets, self.lines = tensors["ids"], tensors["offsets"], tensors["lines"]
        self.rows = rows

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def example(self, index: int):
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.ids[start:end]

    def prompt_ids(self, index: int) -> list[int]:
        return self.example(index).tolist()

    def row(self, index: int) -> dict:
        return self.rows[index]

    def tokens(self) -> int:
        return int(self.ids.numel())

    def target_tokens(self, indices: Sequence[int]) -> int:
        """Prompts carry no loss: a GRPO step's tokens are its completions' (counted once sampled)."""
        return 0

    def collate(self, pack: Sequence[Sequence[int]], pad_id: int, **_layout) -> PromptBatch:
        """A micro-batch of prompts, one a row (GRPO never packs)."""
        return PromptBatch([i for row in pack for i in row])
