"""Read and validate JSONL, tokenize (cached by content hash), and the resumable sampler.

Two line formats: chats ``{"messages": [{"role": ..., "content": ...}, ...]}`` rendered with the
tokenizer's chat template, loss on assistant tokens only; and ``{"text": ...}``, loss on every
token. Labels are masked by position, never by token id: SmolLM2's pad token is also its
end-of-turn token, which the model must learn to emit.
"""

from __future__ import annotations

import hashlib
import json
import re
from array import array
from itertools import accumulate
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

from .. import durable
from ..errors import DataError
from ..home import cache_dir

FORMAT_VERSION = 1  # bump when tokenisation changes, so stale caches are not reused
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class DataFile:
    """A validated data file: its rows and identity."""

    path: Path
    sha256: str
    size: int
    rows: list[dict]


_NOT_TEXT = re.compile("[\x00\ud800-\udfff]")


def text_problem(value: str, key: str) -> str | None:
    """Why a string a tokenizer will see is not text, or None: a lone surrogate (JSON's escape of
    half a pair: no tokenizer takes it, Hugging Face's raises a TypeError) or a NUL (text files do
    not hold one; it is a sign of binary data, and tokenizers differ in what they make of it)."""
    found = _NOT_TEXT.search(value)
    if found is None:
        return None
    at = found.start() + 1
    if found.group() == "\x00":
        return f"{key} holds a NUL character (\\u0000) at character {at}; text has none (binary data?): remove it"
    return (f"{key} holds a lone surrogate (\\u{ord(found.group()):04x}) at character {at}, half of a pair that "
            "no tokenizer takes: write the character itself, or its pair (\\ud83d\\ude00 is one emoji)")


def message_problem(message: object, key: str, roles: Sequence[str], texts: Sequence[str]) -> str | None:
    """Why ``message`` (``key``: where it stands, `messages[2]`) is not an object with a role among
    ``roles`` and string content, or why one of its fields ``texts`` is not text; None when it is fine."""
    if not isinstance(message, dict) or set(message) - {"role", "content", "name"}:
        return f'{key} must be an object with "role" and "content"'
    if message.get("role") not in roles:
        return f'{key}.role is {message.get("role")!r}; use one of {", ".join(roles)}'
    if not isinstance(message.get("content"), str):
        return f"{key}.content must be a string"
    for field in texts:
        value = message.get(field)
        why = text_problem(value, f"{key}.{field}") if isinstance(value, str) else None
        if why:
            return why
    return None


def _check_row(row: object) -> str | None:
    """Why a parsed line is not a valid example, or None."""
    if not isinstance(row, dict):
        return "expected a JSON object"
    has_messages, has_text = "messages" in row, "text" in row
    if has_messages == has_text:
        return 'needs exactly one of "messages" (a chat) or "text" (plain text)'
    if has_text:
        if not isinstance(row["text"], str) or not row["text"].strip():
            return '"text" must be a non-empty string'
        return text_problem(row["text"], '"text"')
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        return '"messages" must be a non-empty list'
    for i, message in enumerate(messages):
        why = message_problem(message, f"messages[{i}]", ROLES, ("content",))
        if why:
            return why
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        return "a chat needs at least one non-empty assistant message (the loss is on assistant tokens)"
    return None


MAX_LINE_BYTES = 64 * 2**20
"""The longest line read as one example: far beyond what [data] max_length keeps of it (131072
tokens), and what bounds the memory one line can take (a 2 GB line is refused after 64 MiB)."""


MAX_NESTING = 100
"""How deep a line's JSON may nest ([ and { inside each other): a chat is 3 deep. Python's decoder
recurses once a level and ends in a RecursionError near 1000, which names no line."""

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def _nesting(chunk: bytes) -> int:
    """How deep the JSON of a line nests, counted outside its strings; 0 when it has at most
    MAX_NESTING opening brackets (it cannot nest deeper: two counts, the common case)."""
    if chunk.count(b"[") + chunk.count(b"{") <= MAX_NESTING:
        return 0
    brackets = _STRING.sub(b"", chunk).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _lines(fh, digest):
    """(number, bytes or None, length) of each line of a binary file, hashing every byte read.

    Lines end at \n, \r\n or \r (as bytes.splitlines: str.splitlines() would also cut at U+2028,
    which JSON allows inside strings). A line past MAX_LINE_BYTES comes as None: the rest of it is
    read in blocks, hashed and dropped, never held."""
    number = 0
    while chunk := fh.readline(MAX_LINE_BYTES + 1):
        digest.update(chunk)
        if len(chunk) > MAX_LINE_BYTES and not chunk.endswith(b"\n"):
            length = len(chunk)
            while True:
                more = fh.readline(1 << 20)
                digest.update(more)
                length += len(more)
                if not more or more.endswith(b"\n"):
                    break
            number += 1
            yield number, None, length
            continue
        for piece in chunk.splitlines():
            number += 1
            yield number, piece, len(piece)


def _parse(path: Path, number: int, chunk: bytes, check):
    """A row of the file, or why line ``number`` is not one (a string)."""
    try:
        line = chunk.decode("utf-8")
    except UnicodeDecodeError as exc:  # replacing it would train on U+FFFD instead of the text
        return (f"{path}:{number}: not valid UTF-8 (byte 0x{chunk[exc.start]:02x} at byte "
                f"{exc.start + 1} of the line); save the file as UTF-8")
    if not line.strip():
        return None
    depth = _nesting(chunk)
    if depth > MAX_NESTING:
        return (f"{path}:{number}: the JSON nests {depth:,} deep ([ and {{ inside each other); lodger reads at most "
                f"{MAX_NESTING} levels (a chat takes 3): is this line an example?")
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno})"
    except RecursionError:  # not expected past _nesting's bound; named all the same, not a crash
        return f"{path}:{number}: the JSON nests deeper than Python's decoder goes: is this line an example?"
    reason = check(row)
    # lodger's line number wins over a "line" key of the row's own: other keys are the user's
    # metadata and are ignored, this one is where errors and samples point.
    return f"{path}:{number}: {reason}" if reason else {**row, "line": number}


def read_jsonl(path: Path, check=None) -> DataFile:
    """Read and validate every line (``check(row)``: why a row is not an example, or None; default
    the SFT shapes); raise one DataError listing the first bad lines. The file is read a line at a
    time: no more than one line (at most MAX_LINE_BYTES) is held beside the rows."""
    check = check or _check_row
    path = Path(path)
    kind = durable.file_kind(path)
    if kind:  # a FIFO would block the read forever, a device never end
        raise DataError(f"{path}: {kind}, not a regular file; a data file is a JSONL file on disk")
    rows, problems, size, digest = [], [], 0, hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for number, chunk, length in _lines(fh, digest):
                if chunk is None:
                    problems.append(f"{path}:{number}: the line is {length:,} bytes, over the {MAX_LINE_BYTES:,} "
                                    "a line may have (one example per line; is this a JSONL file?)")
                    continue
                parsed = _parse(path, number, chunk, check)
                if isinstance(parsed, str):
                    problems.append(parsed)
                elif parsed is not None:
                    rows.append(parsed)
            size = fh.tell()
    except OSError as exc:
        raise DataError(f"{path}: cannot read the data file: {exc}") from None
    if problems:
        shown = "\n".join(f"  - {p}" for p in problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise DataError(f"{len(problems)} bad line(s) in {path}; fix them and run again:\n{shown}{more}")
    if not rows:
        raise DataError(f"{path}: no examples (the file is empty)")
    return DataFile(path, digest.hexdigest(), size, rows)


def _render(tokenizer, messages, generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def encode_row(row: dict, tokenizer, max_length: int, source: str) -> tuple[list[int], list[int]]:
    """Token ids and a 0/1 mask of the positions that carry loss."""
    if "text" in row:
        ids = tokenizer(row["text"], add_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
        ids = ids[:max_length]
        return ids, [1] * len(ids)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{source}:{row['line']}: a chat (\"messages\") needs the tokenizer's chat template, and "
                        "the model of [model] source has none; use {\"text\": ...} lines, or a model with a chat "
                        "template (chat_template.jinja or tokenizer_config.json)")
    messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    full = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], generation_prompt=True)) if i else 0
        turn = _render(tokenizer, messages[: i + 1])
        if not full.startswith(turn) or (i and not turn.startswith(_render(tokenizer, messages[:i], True))):
            raise DataError(f"{source}:{row['line']}: the tokenizer's chat template does not render "
                            "this chat turn by turn; assistant tokens cannot be located")
        spans.append((start, len(turn.rstrip())))  # through the end-of-turn token, not the newline after it
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"][:max_length], encoded["offset_mapping"][:max_length]
    mask = [int(any(s <= begin < e for s, e in spans)) for begin, _ in offsets]
    if not any(mask):
        raise DataError(f"{source}:{row['line']}: no assistant token is left after truncation to "
                        f"[data] max_length = {max_length}; raise max_length or shorten the chat")
    return ids, mask


class ExampleSet(Protocol):
    """What training reads of a tokenized data set, chats (``TokenizedSet``) or preference examples
    (preference.PreferenceSet): examples stored flat (ids, loss mask, ``offsets`` bounding each
    example) so they cache as safetensors, not pickle. Both kinds share these readers; each says
    which of its tokens carry loss (``target_tokens``)."""

    ids: Any  # torch tensors: torch is not imported to read a job's data
    mask: Any
    offsets: Any
    lines: Any

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def example(self, index: int) -> tuple[Any, Any]:
        """An example's (ids, loss mask): all of its trained sequences, side by side."""
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.ids[start:end], self.mask[start:end]

    def tokens(self) -> int:
        return int(self.mask.sum())

    def target_tokens(self, indices: list[int]) -> int:
        """Tokens of these examples that carry loss once collated."""
        ...


class TokenizedSet(ExampleSet):
    """Chat or text examples (one sequence each)."""

    def __init__(self, ids: Any, mask: Any, offsets: Any, lines: Any):
        self.ids, self.mask, self.offsets, self.lines = ids, mask, offsets, lines

    def target_tokens(self, indices: list[int]) -> int:
        """Positions with a label in these examples once collated: the mask without each first
        token (nothing predicts it). Equals counting ``labels[:, 1:] != -100`` of any batching of them."""
        return sum(int(self.mask[int(self.offsets[i]) + 1:int(self.offsets[i + 1])].sum()) for i in indices)


def tokenize(data: DataFile, tokenizer, tokenizer_sha: str, max_length: int) -> TokenizedSet:
    """Tokenise a validated file, reusing the cache keyed by content, tokenizer and max length."""
    import torch
    from safetensors.torch import load_file, save

    key = hashlib.sha256(f"{FORMAT_VERSION}|{data.sha256}|{tokenizer_sha}|{max_length}".encode()).hexdigest()
    cached = cache_dir("tokens") / f"{key[:32]}.safetensors"
    if cached.is_file():
        try:
            t = load_file(str(cached))
            return TokenizedSet(t["ids"], t["mask"], t["offsets"], t["lines"])
        except Exception:  # a damaged cache is rebuilt, never trusted
            cached.unlink(missing_ok=True)  # a cache entry, rewritten durably below: its removal need not last
    # Typed arrays, not lists: 9 bytes a token instead of the ~70 a list of Python ints takes (a
    # million short lines peaked at 1.1 GiB with lists).
    all_ids, all_mask, offsets = array("q"), array("B"), array("q", [0])
    for row in data.rows:
        ids, mask = encode_row(row, tokenizer, max_length, str(data.path))
        all_ids.extend(ids)
        all_mask.extend(mask)
        offsets.append(len(all_ids))
    tensors = {
        "ids": _tensor(all_ids, torch.int64),
        "mask": _tensor(all_mask, torch.uint8),
        "offsets": _tensor(offsets, torch.int64),
        "lines": torch.tensor([r["line"] for r in data.rows], dtype=torch.int64),
    }
    durable.atomic_write(cached, save(tensors))
    return TokenizedSet(tensors["ids"], tensors["mask"], tensors["offsets"], tensors["lines"])


def _tensor(values: array, dtype):
    """A tensor holding a copy of a typed array's values (an empty one has no buffer to view)."""
    import torch

    return torch.frombuffer(bytearray(values), dtype=dtype) if len(values) else torch.zeros(0, dtype=dtype)


def split_indices(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, eval) index split of ``n`` examples."""
    import numpy as np

    if fraction <= 0 or n < 2:
        return list(range(n)), []
    order = np.random.default_rng([seed, 0xE7A1]).permutation(n)
    n_eval = min(n - 1, max(1, round(n * fraction)))
    return sorted(order[n_eval:].tolist()), sorted(order[:n_eval].tolist())


class Sampler:
    """Example order as a pure function of (seed, epoch, position).

    Global position g maps to epoch g // n and place g % n in that epoch's permutation, so a
    resumed run jumps straight to its place: nothing is replayed.
    """

    grouped = False  # examples of similar length drawn together (LengthGroupedSampler)

    def __init__(self, indices: list[int], seed: int):
        self.indices, self.seed = list(indices), seed
        self._epoch = -1
        self._order: Any = None  # this epoch's permutation (numpy), made when first asked

    def __len__(self) -> int:
        return len(self.indices)

    def epoch_order(self, epoch: int):
        """Places in ``indices`` in the order epoch ``epoch`` draws them: a seeded permutation."""
        import numpy as np

        return np.random.default_rng([self.seed, epoch]).permutation(len(self.indices))

    def at(self, position: int) -> int:
        epoch, place = divmod(position, len(self.indices))
        if epoch != self._epoch:
            self._order = self.epoch_order(epoch)
            self._epoch = epoch
        return self.indices[int(self._order[place])]

    def epoch_of(self, position: int) -> float:
        return position / len(self.indices)


class LengthGroupedSampler(Sampler):
    """The shuffled order with examples of similar length drawn together, still a pure function of
    (seed, epoch, position) (the recipe of transformers' ``get_length_grouped_indices``):

    each epoch's permutation (``Sampler``'s, the same for the same seed) is cut into megabatches of
    ``mega`` groups of ``group`` examples (default: 50 groups, or fewer so an epoch holds at least
    4 megabatches), each megabatch sorted longest first (ties in shuffled order) and cut into groups,
    and a megabatch's complete groups are put in a seeded random order (so that length does not fall
    steadily inside a megabatch; transformers keeps them longest first). With ``group`` the
    examples of one optimizer step, every step's examples have similar lengths, steps begin at
    group boundaries, and only an epoch's last step can be short. An epoch is a permutation of the
    examples; the order of each epoch is computed from (seed, epoch) alone (O(n log n), once per
    epoch), so resuming jumps to its position without replaying anything.
    """

    grouped = True

    def __init__(self, indices: list[int], seed: int, lengths, group: int, mega: int | None = None):
        super().__init__(indices, seed)
        if group < 1:
            raise ValueError(f"group ({group}) must be at least 1")
        self.lengths = [int(lengths[i]) for i in self.indices]  # by place, as epoch_order works
        self.group = group
        self.mega = mega or max(1, min(len(self.indices) // (group * 4), 50))

    def epoch_order(self, epoch: int):
        import numpy as np

        shuffled = super().epoch_order(epoch)
        lengths = np.asarray(self.lengths, dtype=np.int64)
        rng = np.random.default_rng([self.seed, epoch, 0x6E0])
        size = self.mega * self.group
        out = []
        for start in range(0, len(shuffled), size):
            mega = shuffled[start:start + size]
            mega = mega[np.argsort(-lengths[mega], kind="stable")]
            groups = [mega[k:k + self.group] for k in range(0, len(mega), self.group)]
            full = [g for g in groups if len(g) == self.group]
            out += [full[k] for k in rng.permutation(len(full))] + groups[len(full):]
        return np.concatenate(out) if out else shuffled


def make_sampler(training, indices: list[int], lengths) -> Sampler:
    """The sampler a job draws its examples with, from ``[training] order``: ``Sampler`` (shuffled)
    or ``LengthGroupedSampler`` in groups of one optimizer step's examples (batch_size x grad_accum
    x world_size). ``lengths`` are token counts by dataset index (``packing.example_lengths``)."""
    if training.order == "length_grouped":
        group = training.batch_size * training.grad_accum * training.world_size
        return LengthGroupedSampler(indices, training.seed, lengths, group)
    return Sampler(indices, training.seed)


def collate(dataset: TokenizedSet, indices: list[int], pad_id: int):
    """Right-padded batch: input_ids, attention_mask and labels (-100 where no loss)."""
    import torch

    examples = [dataset.example(i) for i in indices]
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (ids, mask) in enumerate(examples):
        input_ids[row, : len(ids)] = ids
        attention[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.where(mask.bool(), ids, torch.tensor(-100))
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}
