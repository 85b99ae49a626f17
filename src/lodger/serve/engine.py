"""The generation engine: one base model, several named adapters, each switched atomically.

A request holds the engine lock from its first token to its last, so it is answered wholly by one
adapter version; a newly committed checkpoint is loaded under the same lock and replaces the old
version between requests.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..checkpoint import CheckpointStore
from ..errors import LodgerError
from ..home import run_dir


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
        slot = Slot(name or path.name, "folder", source=path, version=f"{name or path.name}@folder")
        with self.lock:
            self._load_adapter(path, slot.version)
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
        if not slot.source.is_dir():
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
        return [s.version for s in list(self.slots.values()) if s.kind == "run" and self.refresh(s)]

    # -- generation --------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_text(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def generate(self, slot_name: str, ids: list[int], *, max_tokens: int, temperature: float, top_p: float,
                 seed: int | None, stop: list[str], penalties: "Penalties | None" = None,
                 stats: dict | None = None) -> Iterator[tuple[str, str | None, str]]:
        """Yield (text piece, finish reason or None, adapter version), holding the lock throughout;
        ``stats["completion_tokens"]`` counts the tokens generated (the end-of-turn token not included)."""
        import torch

        penalties = penalties or Penalties()
        stats = stats if stats is not None else {}

        with self.lock:
            slot = self.slots[slot_name]
            version = slot.version
            model = self.model
            if slot.kind == "base" and model is not self.base:
                context = model.disable_adapter()
            else:
                context = contextlib.nullcontext()
                if model is not self.base:
                    model.set_adapter(version)
            generator = torch.Generator()
            if seed is not None:
                generator.manual_seed(seed)
            else:
                generator.seed()  # unseeded requests get fresh randomness
            input_ids = torch.tensor([ids])
            cache, produced, text_so_far, sent = None, [], "", 0
            history = penalties.history(ids, self.base.get_output_embeddings().weight.shape[0])
            eos = self.tokenizer.eos_token_id
            holdback = max((len(x) for x in stop if x), default=1) - 1  # a stop string may span tokens
            with context, torch.no_grad():
                for _ in range(max_tokens):
                    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
                    cache = out.cache
                    logits = penalties.apply(out.logits[0, -1].float(), history)
                    token = _sample(logits, temperature, top_p, generator)
                    history.add(token)
                    if token == eos:
                        yield text_so_far[sent:], "stop", version
                        return
                    produced.append(token)
                    stats["completion_tokens"] = len(produced)
                    text_so_far = self.tokenizer.decode(produced, skip_special_tokens=True)
                    hit = next((s for s in stop if s and s in text_so_far), None)
                    if hit:
                        cut = text_so_far.index(hit)
                        yield text_so_far[sent:cut], "stop", version
                        return
                    safe = len(text_so_far) - holdback
                    if safe > sent and not text_so_far[:safe].endswith("\ufffd"):  # whole characters only
                        yield text_so_far[sent:safe], None, version
                        sent = safe
                    input_ids = torch.tensor([[token]])
            yield text_so_far[sent:], "length", version


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


def _sample(logits, temperature: float, top_p: float, generator) -> int:
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


def describe(slot: Slot) -> dict:
    return {"id": slot.name, "object": "model", "created": int(slot.created), "owned_by": "lodger",
            "lodger": {"kind": slot.kind, "version": slot.version, "step": slot.step}}


__all__ = ["Engine", "Penalties", "Slot", "describe"]
