"""Preference data: pairs `{"prompt", "chosen", "rejected"}` (DPO, ORPO) and labelled lines
`{"prompt", "completion", "label"}` (KTO), validated like SFT data, tokenised as TRL 1.16 does,
cached by content, and laid out into batches of sequences.

Shapes (TRL's own): the three fields are all strings (plain text: the prompt, then the completion
with the tokenizer's end-of-sequence token appended) or all message lists (conversational: the
prompt's messages rendered with the chat template and its generation prompt, the completion's
messages after them). The completion starts where the tokenised prompt and prompt + completion
first differ (TRL's ``common_prefix_length``), and only completion tokens carry loss. Each sequence
is cut to [data] max_length from its start; a line whose prompt leaves no completion token is
refused with its line number (TRL drops those lines silently).

An example is one line. Paired objectives train two sequences per example (chosen, rejected), laid
next to each other in ``ids``; KTO trains one, and keeps the line's KL sequence apart (its prompt
with the completion of the line before it in its block of [training] batch_size lines, TRL's
rotation), for the no-grad KL estimate. ``reference`` holds the reference model's summed
log-probabilities per example and sequence, set before step 1 (train/reference.py).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

from .. import durable
from .chats import ROLES, DataFile, ExampleSet, message_problem, text_problem
from ..errors import DataError
from ..home import cache_dir

FORMAT_VERSION = 1
PAIRED = ("dpo", "orpo")
FIELDS = {"dpo": ("prompt", "chosen", "rejected"), "orpo": ("prompt", "chosen", "rejected"),
          "kto": ("prompt", "completion", "label")}


def messages_problem(value: object, key: str, roles: Sequence[str]) -> str | None:
    """Why ``value`` is not a non-empty list of messages with those roles (data/prompts.py reads prompts with it too)."""
    if not isinstance(value, list) or not value:
        return f'"{key}" must be a non-empty string or a non-empty list of messages'
    for i, message in enumerate(value):
        why = message_problem(message, f"{key}[{i}]", roles, ("content", "name"))  # both reach the chat template
        if why:
            return why
    return None


def row_checker(objective: str) -> Callable[[object], str | None]:
    """The line check of ``objective``'s data (data.read_jsonl's ``check``): why a parsed line is
    not an example, or None."""
    fields = FIELDS[objective]

    def check(row: object) -> str | None:
        if not isinstance(row, dict):
            return "expected a JSON object"
        if "messages" in row or "text" in row:
            return (f'a supervised line ("messages"/"text"); objective = "{objective}" needs '
                    + ", ".join(f'"{f}"' for f in fields))
        missing = [f for f in fields if f not in row]
        if missing:
            return f'missing "{missing[0]}" (objective = "{objective}" needs ' + ", ".join(f'"{f}"' for f in fields) + ")"
        if objective == "kto" and not isinstance(row["label"], bool):
            return f'"label" is {row["label"]!r}; it must be true (a good completion) or false (a bad one), without quotes'
        texts = [f for f in fields if f != "label"]
        kinds = {isinstance(row[f], str) for f in texts}
        if len(kinds) > 1:
            return ("mixed shapes: " + ", ".join(f'"{f}"' for f in texts)
                    + " must all be strings or all be message lists")
        if kinds == {True}:
            empty = [f for f in texts if not row[f].strip()]
            if empty:
                return f'"{empty[0]}" is empty'
            for f in texts:
                why = text_problem(row[f], f'"{f}"')
                if why:
                    return why
        else:
            for f in texts:
                why = messages_problem(row[f], f, ROLES if f == "prompt" else ("assistant",))
                if why:
                    return why
        if objective in PAIRED and row["chosen"] == row["rejected"]:
            return '"chosen" and "rejected" are the same: a pair needs two different completions'
        return None

    return check


def encode(tokenizer, prompt: Any, completion: Any) -> tuple[list[int], list[int]]:
    """(prompt ids, prompt + completion ids), untruncated, as TRL tokenises them."""
    if isinstance(prompt, str):
        eos = tokenizer.eos_token or ""
        text = completion if completion.endswith(eos) else completion + eos
        return tokenizer(text=prompt)["input_ids"], tokenizer(text=prompt + text)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("message lists need the tokenizer's chat template, and the model of [model] source has "
                        "none; write the fields as strings, or use a model with a chat template")
    prompt_ids = tokenizer.apply_chat_template(prompt, tokenize=True, return_dict=True,
                                               add_generation_prompt=True)["input_ids"]
    full = tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"]
    return list(prompt_ids), list(full)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _sequence(prompt: list[int], completion: list[int], max_length: int) -> tuple[list[int], list[int]]:
    ids = (prompt + completion)[:max_length]
    return ids, ([0] * len(prompt) + [1] * len(completion))[:max_length]


def _kl_partners(n: int, block: int) -> list[int]:
    """Whose completion each line's KL sequence takes: the line before it in its block of ``block``
    lines, the block's first taking its last (TRL's rotation by one within each batch)."""
    out = []
    for start in range(0, n, block):
        members = list(range(start, min(start + block, n)))
        out += [members[-1]] + members[:-1]
    return out


def _encode_file(data: DataFile, tokenizer, max_length: int, objective: str, kl_block: int):
    """Per line: its trained sequences, and (KTO) its KL sequence; one DataError for every line
    whose prompt leaves no completion token."""
    parts, short = [], []
    for row in data.rows:
        try:
            if objective in PAIRED:
                prompt, chosen = encode(tokenizer, row["prompt"], row["chosen"])
                _, rejected = encode(tokenizer, row["prompt"], row["rejected"])
                cut = min(common_prefix(prompt, chosen), common_prefix(prompt, rejected))
                parts.append((prompt[:cut], [chosen[cut:], rejected[cut:]]))
            else:
                prompt, full = encode(tokenizer, row["prompt"], row["completion"])
                cut = common_prefix(prompt, full)
                parts.append((prompt[:cut], [full[cut:]]))
        except DataError as exc:
            raise DataError(f"{data.path}:{row['line']}: {exc}") from None
        if len(parts[-1][0]) + 1 >= max_length:  # the first completion token must still be predicted
            short.append(row["line"])
    if short:
        shown = ", ".join(map(str, short[:10])) + (f" and {len(short) - 10} more" if len(short) > 10 else "")
        raise DataError(f"{data.path}: {len(short)} of {len(data.rows)} line(s) have a prompt of at least "
                        f"[data] max_length = {max_length} tokens, so no completion token would be trained "
                        f"(lines {shown}); raise max_length or shorten those prompts")
    sequences = [[_sequence(prompt, c, max_length) for c in completions] for prompt, completions in parts]
    kl = None
    if objective == "kto":
        kl = [_sequence(parts[i][0], parts[j][1][0], max_length) for i, j in
              enumerate(_kl_partners(len(parts), kl_block))]
    return sequences, kl


def flatten(examples: list[list[tuple[list[int], list[int]]]]):
    """Examples of (ids, mask) sequences as flat tensors: ids, mask, offsets (per example), splits."""
    import torch

    ids: list[int] = []
    mask: list[int] = []
    offsets, splits = [0], []
    for sequences in examples:
        splits.append(len(ids) + len(sequences[0][0]))
        for seq_ids, seq_mask in sequences:
            ids += seq_ids
            mask += seq_mask
        offsets.append(len(ids))
    return {"ids": torch.tensor(ids, dtype=torch.int64), "mask": torch.tensor(mask, dtype=torch.uint8),
            "offsets": torch.tensor(offsets, dtype=torch.int64), "splits": torch.tensor(splits, dtype=torch.int64)}


def tokenize_preference(data: DataFile, tokenizer, tokenizer_sha: str, max_length: int, objective: str,
                        kl_block: int = 1) -> "PreferenceSet":
    """Tokenise a validated preference file, reusing the cache keyed by content, tokenizer, max
    length, objective and (KTO) the KL block size."""
    import torch
    from safetensors.torch import load_file, save

    block = kl_block if objective == "kto" else 0
    key = hashlib.sha256(f"pref{FORMAT_VERSION}|{objective}|{block}|{data.sha256}|{tokenizer_sha}|"
                         f"{max_length}".encode()).hexdigest()
    cached = cache_dir("tokens") / f"{key[:32]}.safetensors"
    if cached.is_file():
        try:
            return PreferenceSet.from_tensors(objective, load_file(str(cached)))
        except Exception:  # a damaged cache is rebuilt, never trusted
            cached.unlink(missing_ok=True)  # a cache entry, rewritten durably below: its removal need not last
    sequences, kl = _encode_file(data, tokenizer, max_length, objective, block)
    tensors = flatten(sequences)
    tensors["lines"] = torch.tensor([r["line"] for r in data.rows], dtype=torch.int64)
    if objective == "kto":
        tensors["labels"] = torch.tensor([r["label"] for r in data.rows], dtype=torch.bool)
        tensors.update({f"kl_{k}": v for k, v in flatten([[s] for s in kl]).items() if k != "splits"})
    durable.atomic_write(cached, save(tensors))
    return PreferenceSet.from_tensors(objective, tensors)


class PreferenceSet(ExampleSet):
    """Preference examples stored flat (safetensors, no pickle). ``offsets`` bound each example's
    trained sequences (both of a pair, side by side; KTO's one), so an example's length is what a
    packed row holds of it; ``splits`` is where a pair's second sequence starts."""

    preference = True

    def __init__(self, objective: str, t: dict):
        self.objective, self.t = objective, t
        self.ids, self.mask, self.offsets, self.lines = t["ids"], t["mask"], t["offsets"], t["lines"]
        self.per_example = 2 if objective in PAIRED else 1
        self.labels = t.get("labels")
        self.reference = None  # [examples, 2] float32: (chosen, rejected) or (completion, KL), train/reference.py

    @classmethod
    def from_tensors(cls, objective: str, tensors: dict) -> "PreferenceSet":
        return cls(objective, tensors)

    def sequences(self, index: int, kl: bool = False) -> list[tuple[Any, Any]]:
        """The example's trained sequences as (ids, mask) (``kl``: its KL sequence, KTO only)."""
        if kl:
            start, end = int(self.t["kl_offsets"][index]), int(self.t["kl_offsets"][index + 1])
            return [(self.t["kl_ids"][start:end], self.t["kl_mask"][start:end])]
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        if self.per_example == 1:
            return [(self.ids[start:end], self.mask[start:end])]
        split = int(self.t["splits"][index])
        return [(self.ids[start:split], self.mask[start:split]), (self.ids[split:end], self.mask[split:end])]

    def target_tokens(self, indices: list[int]) -> int:
        """Completion tokens of these examples' trained sequences that carry loss (each sequence's
        first token predicts nothing)."""
        return sum(int(m[1:].sum()) for i in indices for _, m in self.sequences(i))

    def chosen_tokens(self, indices: list[int]) -> int:
        """Of those, the chosen sequences' (ORPO's NLL term is normalised by them)."""
        return sum(int(self.sequences(i)[0][1][1:].sum()) for i in indices)

    def collate(self, pack: Sequence[Sequence[int]], pad_id: int, *, packed: bool, explicit_mask: bool = False,
                segments: bool = False):
        """One micro-batch: padded (one sequence a row, chosen rows then rejected rows, as TRL
        concatenates them) or packed (each row's examples' sequences side by side, position ids
        restarting per sequence). ``sequence`` numbers each position's sequence (-1: no label):
        sequence s of the k-th example is s x examples + k. With ``reference`` set, the
        reference log-probabilities in that order; KTO adds ``label`` and the ``kl_`` batch."""
        from .packing import lay_out

        examples = [i for row in pack for i in row]
        n = len(examples)
        place = {index: k for k, index in enumerate(examples)}

        def seqs(kl: bool):
            if packed:
                return [[(self.sequences(i, kl)[s], s * n + place[i]) for i in row
                         for s in range(1 if kl else self.per_example)] for row in pack]
            return [[(self.sequences(i, kl)[s], s * n + k)] for s in range(1 if kl else self.per_example)
                    for k, i in enumerate(examples)]

        batch = lay_out(seqs(False), pad_id, packed=packed, explicit_mask=explicit_mask, segments=segments)
        if self.reference is not None:
            ref = self.reference[examples]
            batch.tensors["reference"] = ref[:, :self.per_example].T.reshape(-1).clone()
            if self.labels is not None:
                batch.tensors["kl_reference"] = ref[:, 1].clone()
        if self.labels is not None:
            batch.tensors["label"] = self.labels[examples].clone()
            kl = lay_out(seqs(True), pad_id, packed=packed, explicit_mask=explicit_mask, segments=segments)
            batch.tensors.update({f"kl_{k}": v for k, v in kl.tensors.items()})
        batch.sequences = n * self.per_example
        return batch
