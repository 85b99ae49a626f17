"""The generation engine: one base model, several named adapters, each switched atomically.

A request holds the engine lock from its first token to its last, so it is answered wholly by one
adapter version; a newly committed checkpoint is loaded under the same lock and replaces the old
version between requests.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..checkpoint import CheckpointStore
from ..errors import LodgerError
from ..home import run_dir
from .decode import Penalties, Piece, Rules, TokenInfo, prompt_report

PREFILL_CHUNK = 512  # prompt positions per forward pass when every prompt token is reported


@dataclass
class Slot:
    """A served name and the adapter version that currently answers for it."""

    name: str
    kind: str                      # "base", "run", "checkpoint" (one fixed step) or "folder"
    source: Path | None = None     # the run's checkpoints folder, or the adapter folder
    run_id: str | None = None
    version: str | None = None     # the peft adapter name now loaded, e.g. "myrun@step-00000020"
    step: int | None = None
    created: float = field(default_factory=time.time)


class Engine:
    """One base model in memory and the named slots served from it (``base``, a run's newest
    checkpoint, one fixed checkpoint, an adapter folder), each answered by one adapter version.

    Every adapter is verified (sizes, hashes) before it is loaded; ``refresh_all`` moves run slots
    to newer checkpoints. ``lock`` is held by a generation from its first token to its last and by
    every adapter switch, so a request never sees two versions. No HTTP here: app.py is the server.
    """

    def __init__(self, model_folder: Path, threads: int | None = None):
        import torch

        from ..model import load_base_model, load_tokenizer

        if threads:
            torch.set_num_threads(threads)
        self.tokenizer = load_tokenizer(model_folder)
        self.base = load_base_model(model_folder)
        self.base.config.use_cache = True
        self.base.eval()
        self.model = self.base          # becomes a PeftModel once an adapter is loaded
        self.lock = threading.RLock()
        self.slots: dict[str, Slot] = {"base": Slot("base", "base", version="base")}
        self.context_length = int(getattr(self.base.config, "max_position_embeddings", 2048))

    # -- adapters ----------------------------------------------------------------------------
    def _load_adapter(self, path: Path, version: str) -> None:
        from peft import PeftModel

        if self.model is self.base:
            self.model = PeftModel.from_pretrained(self.base, str(path), adapter_name=version)
        else:
            self.model.load_adapter(str(path), adapter_name=version)
        self.model.eval()

    def add_folder(self, path: Path, name: str | None = None) -> Slot:
        path = Path(path)
        if not (path / "adapter_config.json").is_file():
            raise LodgerError(f"{path}: not an adapter folder (no adapter_config.json)")
        version = f"{name or path.name}@folder"
        slot = Slot(name or path.name, "folder", source=path, version=version)
        with self.lock:
            self._load_adapter(path, version)
            self.slots[slot.name] = slot
        return slot

    def add_run(self, run_id: str, method: str) -> Slot:
        if method != "lora":
            raise LodgerError(f"run {run_id} trains all weights ({method}); serve its exported folder as a model")
        slot = Slot(run_id, "run", source=run_dir(run_id) / "checkpoints", run_id=run_id)
        self.slots[run_id] = slot
        if not self.refresh(slot):
            del self.slots[run_id]
            raise LodgerError(f"run {run_id} has no committed checkpoint yet; serve it once one is committed")
        return slot

    def refresh(self, slot: Slot) -> bool:
        """Switch a run's slot to its newest verified checkpoint if that is newer; True if loaded."""
        if slot.source is None or not slot.source.is_dir():
            return False
        store = CheckpointStore(slot.source, keep_last=2)
        for step, path in store.committed():
            if slot.step is not None and step <= slot.step:
                return False
            try:
                checkpoint = store.load(path)  # verify sizes and hashes before trusting the files
            except (LodgerError, OSError):
                continue  # damaged, or pruned under our feet: try the next newest
            version = f"{slot.run_id}@{path.name}"
            with self._verified_adapter(checkpoint, version):
                old, slot.version, slot.step = slot.version, version, step
                if old and old != version:
                    self.model.delete_adapter(old)
            return True
        return False

    def add_checkpoint(self, run_id: str, step: int) -> Slot:
        """Serve one fixed checkpoint of a run as `RUN@step-NNNNNNNN` (to compare it with the newest)."""
        store = CheckpointStore(run_dir(run_id) / "checkpoints", keep_last=2)
        found = dict(store.committed())
        if step not in found:
            have = ", ".join(str(s) for s in sorted(found)) or "none"
            raise LodgerError(f"run {run_id} has no committed checkpoint at step {step} (committed: {have})")
        name = f"{run_id}@{found[step].name}"
        if name not in self.slots:
            with self._verified_adapter(store.load(found[step]), name):
                self.slots[name] = Slot(name, "checkpoint", source=found[step], run_id=run_id, version=name,
                                        step=step)
        return self.slots[name]

    @contextlib.contextmanager
    def _verified_adapter(self, checkpoint, version: str):
        """Load an adapter from a verified checkpoint's bytes under the engine lock, then run the body.

        The bytes are copied aside before waiting for the lock: training may prune the checkpoint
        folder while a long request holds the engine."""
        with tempfile.TemporaryDirectory(prefix="lodger-adapter-") as tmp:
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                (Path(tmp) / name).write_bytes(checkpoint.files[name])
            with self.lock:
                try:
                    self._load_adapter(Path(tmp), version)
                except Exception:
                    # a half-added adapter would make every retry fail with "already exists"
                    if version in getattr(self.model, "peft_config", {}):
                        self.model.delete_adapter(version)
                    raise
                yield

    def refresh_all(self) -> list[str]:
        return [s.version for s in list(self.slots.values())
                if s.kind == "run" and self.refresh(s) and s.version is not None]  # a refreshed slot has one

    # -- generation --------------------------------------------------------------------------
    @property
    def vocab(self) -> int:
        """The logits' length (may exceed the tokenizer's, when the embedding is padded)."""
        return int(self.base.get_output_embeddings().weight.shape[0])

    @functools.cached_property
    def vocabulary(self):
        """The tokenizer as llguidance reads it (grammars, token bytes), built on first use."""
        from .structured import Vocabulary

        return Vocabulary(self.tokenizer, self.vocab)

    @functools.cached_property
    def token_bytes_bound(self) -> int:
        """No token stands for more bytes of text than this: the longest vocabulary entry (special
        tokens included) in UTF-8, doubled for what a normaliser may fold. So a text of N bytes is
        at least N // bound tokens, known before tokenising it."""
        return 2 * max((len(t.encode("utf-8")) for t in self.tokenizer.get_vocab()), default=1)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.tokenizer(self.chat_text(messages, tools), add_special_tokens=False)["input_ids"]

    def chat_text(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        extra = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)

    def encode_text(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def encode_prompt(self, prompt: str | list[int]) -> tuple[list[int], str, list[int]]:
        """(ids, text, where each token's text starts in it) of a completion prompt, a string or ids."""
        if isinstance(prompt, str):
            encoded = self.tokenizer(prompt, add_special_tokens=True, return_offsets_mapping=True)
            return encoded["input_ids"], prompt, [start for start, _ in encoded["offset_mapping"]]
        # token ids: the text of their bytes, read once through an incremental decoder (a character
        # split over tokens starts where it is completed), so a long prompt costs one pass
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        parts, offsets, length = [], [], 0
        for token in prompt:
            offsets.append(length)
            parts.append(decoder.decode(self.vocabulary.token_bytes(token)))
            length += len(parts[-1])
        parts.append(decoder.decode(b"", final=True))
        return list(prompt), "".join(parts), offsets

    def generate(self, slot_name: str, ids: list[int], *, max_tokens: int, temperature: float, top_p: float,
                 seed: int | None, stop: list[str], penalties: Penalties | None = None,
                 stats: dict | None = None) -> Iterator[tuple[str, str | None, str]]:
        """(text piece, finish reason or None, adapter version) of ``stream`` with plain sampling."""
        rules = Rules(temperature=temperature, top_p=top_p, seed=seed, penalties=penalties or Penalties())
        for piece in self.stream(slot_name, ids, max_tokens=max_tokens, rules=rules, stop=stop, stats=stats):
            yield piece.text, piece.finish, piece.version

    def stream(self, slot_name: str, ids: list[int], *, max_tokens: int, rules: Rules, stop: list[str],
               stats: dict | None = None, echo: list[int] | None = None) -> Iterator[Piece]:
        """Pieces of the answer, holding the lock throughout; ``stats["completion_tokens"]`` counts the
        tokens generated (the end-of-turn token not included). ``echo`` (where each prompt token's
        text starts): the first piece reports every prompt token."""
        import torch

        stats = stats if stats is not None else {}
        with self.lock:
            version, model, context = self._select(slot_name)
            with context, torch.no_grad():
                if echo is None:
                    out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
                else:
                    out, infos = self._reported_prefill(model, ids, rules.report or 0, echo)
                    yield Piece("", None, version, infos, prompt=True)
                if max_tokens == 0:
                    yield Piece("", "length", version)
                    return
                yield from self._decode(model, out, ids, version, max_tokens, rules, stop, stats)

    def _reported_prefill(self, model, ids: list[int], top: int, offsets: list[int]):
        """The prompt's forward pass with every prompt token reported (lm-eval's log-likelihoods),
        ``PREFILL_CHUNK`` positions at a time through the cache, so the logits held are a chunk's,
        not the prompt's length times the vocabulary. Returns (the last chunk's output, reports)."""
        import torch

        out, infos = None, [TokenInfo(ids[0], None, (), offsets[0])]  # the first token has no context
        for start in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[start:start + PREFILL_CHUNK]
            out = model(input_ids=torch.tensor([chunk]), cache=out.cache if out else None, use_cache=True,
                        logits_to_keep=0)
            targets = ids[start + 1:start + 1 + len(chunk)]  # each position predicts the next token
            if targets:
                infos += prompt_report(out.logits[0, :len(targets)], targets, top,
                                       offsets[start + 1:start + 1 + len(targets)])
        return out, infos

    def _select(self, slot_name: str):
        """(version, model, context) answering for a slot; called under the lock."""
        slot = self.slots[slot_name]
        model = self.model
        if slot.kind == "base" and model is not self.base:
            return slot.version, model, model.disable_adapter()
        if model is not self.base:
            model.set_adapter(slot.version)
        return slot.version, model, contextlib.nullcontext()

    def _decode(self, model, out, ids, version, max_tokens, rules: Rules, stop, stats) -> Iterator[Piece]:
        """The token loop from the prompt's forward pass ``out``: text in whole characters, held back
        while a stop string may be forming; each token reported in the piece its text starts in."""
        import torch

        generator = rules.generator()
        history = rules.penalties.history(ids, self.vocab)
        eos = self.tokenizer.eos_token_id
        holdback = max((len(x) for x in stop if x), default=1) - 1  # a stop string may span tokens
        produced: list[int] = []
        pending: list[TokenInfo] = []
        text, sent = "", 0
        for n in range(max_tokens):
            if n:
                out = model(input_ids=torch.tensor([[produced[-1]]]), cache=out.cache, use_cache=True,
                            logits_to_keep=1)
            token, info = rules.choose(out.logits[0, -1].float(), history, generator)
            history.add(token)
            if token == eos:
                yield Piece(text[sent:], "stop", version, pending)
                return
            if info is not None:
                pending.append(TokenInfo(info.id, info.logprob, info.top, len(text)))
            produced.append(token)
            stats["completion_tokens"] = len(produced)
            text = self.tokenizer.decode(produced, skip_special_tokens=True)
            hit = next((s for s in stop if s and s in text), None)
            if hit:
                cut = text.index(hit)
                yield Piece(text[sent:cut], "stop", version, [t for t in pending if t.offset < cut])
                return
            safe = len(text) - holdback
            if safe > sent and not text[:safe].endswith("\ufffd"):  # whole characters only
                ready = [t for t in pending if t.offset < safe]
                pending = pending[len(ready):]
                yield Piece(text[sent:safe], None, version, ready)
                sent = safe
        yield Piece(text[sent:], "length", version, pending)


def describe(slot: Slot) -> dict:
    return {"id": slot.name, "object": "model", "created": int(slot.created), "owned_by": "lodger",
            "lodger": {"kind": slot.kind, "version": slot.version, "step": slot.step}}


__all__ = ["Engine", "Penalties", "Piece", "Rules", "Slot", "describe"]
