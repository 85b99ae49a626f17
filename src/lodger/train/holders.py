"""What a checkpoint holds, declared once: a map of named state holders.

Each holder has ``state_dict()``, ``load_state_dict(entries)`` and ``problems(entries, step,
world_size)`` (what ``load_state_dict`` would miss in a checkpoint: the checkpointer's
``check_contents`` asks every holder, so what is saved, restored and checked is declared in one
place; ``world_size`` comes from the checkpoint's manifest). Its state_dict returns
checkpoint entries: a name with a dot is a file of its own in the step folder
(``adapter_model.safetensors``, ``optimizer.json``, ``rng.safetensors``); a name without one is a
key of ``state.json`` (``progress``, ``rng``, ``guard``, ...). Saving iterates the map and writes
what it collected; restoring iterates the same map over the checkpoint's entries. The learning
rate has no holder of its own: it is a function of the step and the guard's ``lr_scale``.

Today's files (and their bytes) are the contract: resume of existing checkpoints depends on it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Iterator, Protocol

from ..errors import RunStateError

if TYPE_CHECKING:
    import torch

    from ..config import MethodConfig
    from ..data.preference import PreferenceSet
    from .grpo import GRPO
    from .guard import Guard
    from .precision import Precision
    from .record import Recorder


def declare(*, facts: RunFacts, model: torch.nn.Module, method: MethodConfig, optimizer: torch.optim.Optimizer,
            sync: Any, progress: StateHolder, recorder: Recorder, guard: Guard, precision: Precision,
            train_set: Any, eval_set: Any, objective: Any = None) -> dict[str, "StateHolder"]:
    """The map of what a checkpoint holds, by name: the one place it is declared. Save, restore and
    the pre-restore check all iterate it (train/checkpointer.py)."""
    state: dict[str, StateHolder] = {
        "facts": facts, "weights": Weights(model, method), "optimizer": Optimizer(optimizer), "rng": Rng(sync),
        "progress": progress, "evals": Evals(recorder), "guard": GuardHolder(guard), "scaler": Scaler(precision)}
    if getattr(method, "objective", "sft") in REFERENCED:
        state["reference"] = Reference(train_set, eval_set)
    if objective is not None and getattr(objective, "name", "") == "grpo" and objective.cfg.num_iterations > 1:
        state["rollouts"] = Rollouts(objective, progress)
    return state


REFERENCED = ("dpo", "kto")  # objectives measured against a reference model (ORPO has none)


class StateHolder(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, entries: Mapping[str, Any]) -> None: ...

    def problems(self, entries: Mapping[str, Any], step: int, world_size: int) -> list[str]: ...


def file_problems(entries: Mapping[str, Any], name: str, keys: tuple[str, ...] = ()) -> list[str]:
    """Why the file ``name`` cannot be read back: missing, not a valid safetensors file, or (JSON)
    not an object or lacking one of ``keys``."""
    from ..checkpoint import safetensors_problem

    files = getattr(entries, "files", entries)
    if name not in files:
        return [f"no {name}"]
    if name.endswith(".safetensors"):
        why = safetensors_problem(files[name])
        return [f"{name}: {why}"] if why else []
    try:
        parsed = json.loads(files[name])
    except ValueError as exc:
        return [f"{name} is not valid JSON ({exc})"]
    if not isinstance(parsed, dict):
        return [f"{name} is not a JSON object"]
    return [f"{name} lacks `{k}`" for k in keys if k not in parsed]


def state_key_problems(entries: Mapping[str, Any], key: str, subkeys: tuple[str, ...] = ()) -> list[str]:
    """Why state.json's ``key`` (an object with ``subkeys``) cannot be read back."""
    state = getattr(entries, "state", {})
    if key not in state:
        return [f"state.json lacks `{key}`"]
    if not subkeys:
        return []
    if not isinstance(state[key], dict):
        return [f"state.json `{key}` is not an object"]
    return [f"state.json lacks `{key}.{k}`" for k in subkeys if k not in state[key]]


@dataclass
class Progress:
    """Counters saved in every checkpoint."""

    step: int = 0        # optimizer steps taken
    position: int = 0    # examples drawn from the sampler (global position across epochs)
    tokens: int = 0      # target tokens trained on
    segment: int = 0     # 0 for the first start, +1 at every resume

    def state_dict(self) -> dict[str, Any]:
        return {"progress": asdict(self)}

    def load_state_dict(self, entries: Mapping[str, Any]) -> None:
        for key, value in entries["progress"].items():  # in place: the loop holds this object
            setattr(self, key, value)

    def problems(self, entries: Mapping[str, Any], step: int, world_size: int) -> list[str]:
        found = state_key_problems(entries, "progress", tuple(f.name for f in fields(Progress)))
        saved = getattr(entries, "state", {}).get("progress")
        if isinstance(saved, dict) and "step" in saved and saved["step"] != step:
            found.append(f"state.json says step {saved['step']!r}, its folder step {step}")
        return found


class Entries(Mapping):
    """A checkpoint's entries as holders read them: files by name, state.json keys by key."""

    def __init__(self, files: Mapping[str, Any], state: dict[str, Any]):
        self.files, self.state = files, state

    def __getitem__(self, key: str) -> Any:
        return self.files[key] if "." in key else self.state[key]

    def __iter__(self) -> Iterator[str]:
        yield from self.files
        yield from self.state

    def __len__(self) -> int:
        return len(self.files) + len(self.state)


def split_entries(entries: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(files, state.json contents) of what the holders returned."""
    files = {name: value for name, value in entries.items() if "." in name}
    return files, {key: value for key, value in entries.items() if "." not in key}


def weights_file(method: MethodConfig) -> str:
    return "adapter_model.safetensors" if method.kind == "lora" else "model.safetensors"


class Weights:
    """The trainable weights: the LoRA adapter (peft layout) or the full model."""

    def __init__(self, model: torch.nn.Module, method: MethodConfig):
        self.model, self.method = model, method

    def state_dict(self) -> dict[str, Any]:
        from ..model import adapter_files

        return adapter_files(self.model, self.method)

    def load_state_dict(self, entries: Mapping[str, Any]) -> None:
        from safetensors.torch import load as load_tensors

        from ..model import load_trainable_state

        load_trainable_state(self.model, self.method, load_tensors(entries[weights_file(self.method)]))

    def problems(self, entries: Mapping[str, Any], step: int, world_size: int) -> list[str]:
        return file_problems(entries, weights_file(self.method))


class Optimizer:
    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from .optim import optimizer_files

        return optimizer_files(self.optimizer)

    def load_state_dict(self, entries: Mapping[str, Any]) -> None:
        from .optim import load_optimizer

        load_optimizer(self.optimizer, entries)

    def problems(self, entries: Mapping[str, Any], step: int, world_size: int) -> list[str]:
        return (file_problems(entries, "optimizer.json", ("param_groups", "plain"))
                + file_problems(entries, "optimizer.safetensors"))


class Rng:
    """Every random generator. Rank 0's go to rng.safetensors and state.json `rng`; with several
    ranks every other rank's is gathered to rank 0 as rng-rank-N.json (the sync's collective)."""

    def __init__(self, sync: Any):  # train/sync.py's LocalSync or DataParallelSync: the rank's collectives
        self.sync = sync

    def state_dict(self) -> dict[str, Any]:
        from safetensors.torch import save as save_tensors

        from ..rng import capture
        from ..rng import to_json as rng_to_json

        tensors, state = capture()
        gathered = self.sync.gather_rng(lambda: rng_to_json(tensors, state))
        ranks = {f"rng-rank-{r}.json": json.dumps(gathered[r], sort_keys=True).encode()
                 for r in range(1, len(gathered or []))}
        return {"rng.safetensors": save_tensors(tensors), "rng": state, **ranks}

    def load_state_dict(self, entries: Mapping[str, Any]) -> None:
        from safetensors.torch import load as load_tensors

        from ..rng import from_json as rng_from_json
        from ..rng import restore as restore_rng

        if self.sync.rank == 0:
            restore_rng(load_tensors(entries["rng.safetensors"]), entries["rng"])
        else:
            restore_rng(*rng_from_json(json.loads(entries[f"rng-rank-{self.sync.rank}.json"])))

    def problems(self, entries: Mapping[str, Any], step: int, world_size: int) -> list[str]:
        found = file_problems(entries, "rng.safetensors")
        for rank in range(1, world_size):  # every rank's generators, as many as the manifest says
            found += file_problems(entries, f"rng-rank-{rank}.json")
        return found + state_key_problems(entries, "rng", ("python", "numpy"))


class Evals:
    """Eval results by step (the recorder's), so a resume knows which evals already ran."""

    def __init__(self, recorder: Recorder):
        self.recorder = recorder

    def state_dict(self) -> dict[str, Any]:
        return {"evals": self.recorder.evals}

    def load_state_dict(self, entries: Mapping[str, Any]) -> None:
        self.recorder.evals = {int(k): v for k, v in entries.get("evals", {}).items()}

    def problems(self, entries: Mapping[str, Any], step: int, world_size: int) -> list[str]:
        return []  # optional: older checkpoints lack it and restore the default


class GuardHolder:
    def __init__(self, guard: Guard):
        self.guard = guard

    def state_dict(self) -> dict[str, Any]:
        return {"guard": self.guard.as_dict()}

    def load_state_dict(self, entries: Mapping[str, Any]) -> None:
        from .guard import GuardState

        self.guard.state = GuardState(**entries.get("guard", {}))

    def problems(self, entries: Mapping[str, Any], step: int, world_size: int) -> list[str]:
        return []  # optional: older checkpoints lack it and restore the default


class Scaler:
    """The fp16 loss scaler's state ({} in other precisions)."""

    def __init__(self, precision: Precision):
        self.precision = precision

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.precision.state()}

    def load_state_dict(self, entries: Mapping[str, Any]) -> None:
        self.precision.load(entries.get("scaler", {}))

    def problems(self, entries: Mapping[str, Any], step: int, world_size: int) -> list[str]:
        return []  # optional: older checkpoints lack it and restore the default


class RunFacts:
    """What the checkpoint was trained on (data, model, numerics): checked on load, not restored.
    ``drift`` holds the numerics differences found by the latest load."""

    def __init__(self, run_id: str, prepared: Any, fingerprint: dict[str, Any], reward_files: dict[str, str] | None = None,
                 base: dict[str, Any] | None = None):
        self.run_id, self.p, self.fingerprint = run_id, prepared, fingerprint
        self.reward_files = reward_files or {}  # GRPO: {reward: sha256 of the owner's file}
        # [method] base_bits: the quantised base as quant.facts describes it (its sha256 stands in for its bytes)
        self.base = {k: v for k, v in (base or {}).items() if k in BASE_KEYS}
        self.drift: list[str] = []

    def state_dict(self) -> dict[str, Any]:
        p = self.p
        facts = {"numerics": self.fingerprint, "total_steps": p.total_steps,
                 "data": {"train_sha256": p.train_file.sha256,
                          "eval_sha256": p.eval_file.sha256 if p.eval_file else None},
                 "model_sha256": p.source.sha256}
        if self.reward_files:
            facts["reward_files"] = self.reward_files
        if self.base:
            facts["base"] = self.base
        return facts

    def load_state_dict(self, entries: Mapping[str, Any]) -> None:
        from ..ledger import provenance as prov

        p, data = self.p, entries["data"]
        for key, now in (("train_sha256", p.train_file.sha256),
                         ("eval_sha256", p.eval_file.sha256 if p.eval_file else None)):
            if data[key] != now:
                raise RunStateError(f"run {self.run_id}: the data file changed since the checkpoint "
                                    f"({key.split('_')[0]}: recorded {data[key]}, now {now}); "
                                    "restore the original file or start a new run")
        if entries["model_sha256"] != p.source.sha256:
            raise RunStateError(f"run {self.run_id}: the model changed since the checkpoint (recorded "
                                f"{entries['model_sha256']}, now {p.source.sha256})")
        self.drift = prov.drift(entries["numerics"], self.fingerprint)
        self.drift += base_drift(self.run_id, entries.get("base") or {}, self.base)
        recorded = entries.get("reward_files") or {}
        for label in sorted(set(recorded) | set(self.reward_files)):
            if recorded.get(label) != self.reward_files.get(label):  # a fixed reward: allowed, and said
                self.drift.append(f"reward {label}'s file changed (sha256 {str(recorded.get(label))[:12]} at the "
                                  f"checkpoint, {str(self.reward_files.get(label))[:12]} now)")

    def problems(self, entries: Mapping[str, Any], step: int, world_size: int) -> list[str]:
        return (state_key_problems(entries, "numerics") + state_key_problems(entries, "model_sha256")
                + state_key_problems(entries, "data", ("train_sha256", "eval_sha256")))


BASE_KEYS = ("bits", "format", "library", "version", "sha256")


def base_drift(run_id: str, recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """A quantised base checked against the checkpoint's record of it: the same quantised bytes (a
    changed library version that quantises alike is drift, said), or a refusal naming both."""
    if recorded.get("sha256") == now.get("sha256"):
        if recorded.get("version") != now.get("version"):
            return [f"base {recorded.get('library')}: {recorded.get('version')!r} -> {now.get('version')!r} (the "
                    "quantised base is bitwise the same)"]
        return []
    said = {key: f"{d.get('bits')}-bit, {d.get('library')} {d.get('version')}, sha256 {str(d.get('sha256'))[:12]}"
            if d else "fp32" for key, d in (("recorded", recorded), ("now", now))}
    raise RunStateError(f"run {run_id}: the quantised base differs from the one its checkpoint was trained on "
                        f"(at the checkpoint: {said['recorded']}; now: {said['now']}); a resume would not be exact. "
                        "Reinstall the recorded library version (`lodger show RUN` lists it), or start a new run")


class Reference:
    """DPO's and KTO's reference log-probabilities (train/reference.py), a table per data set, so a
    resume uses the numbers the run began with: ``reference.safetensors``."""

    NAME = "reference.safetensors"

    def __init__(self, train_set: PreferenceSet, eval_set: PreferenceSet | None):
        self.sets = {"train": train_set, **({"eval": eval_set} if eval_set is not None and eval_set is not train_set
                                            else {})}

    def state_dict(self) -> dict[str, Any]:
        from safetensors.torch import save as save_tensors

        return {self.NAME: save_tensors({role: s.reference for role, s in self.sets.items()})}

    def load_state_dict(self, entries: Mapping[str, Any]) -> None:
        from safetensors.torch import load as load_tensors

        tables = load_tensors(entries[self.NAME])
        for role, dataset in self.sets.items():
            dataset.reference = tables[role]

    def problems(self, entries: Mapping[str, Any], step: int, world_size: int) -> list[str]:
        found = file_problems(entries, self.NAME)
        if found:
            return found
        from safetensors.torch import load as load_tensors

        tables = load_tensors(getattr(entries, "files", entries)[self.NAME])
        for role, dataset in self.sets.items():
            shape = tuple(tables[role].shape) if role in tables else None
            if shape != (len(dataset), 2):
                found.append(f"{self.NAME}: `{role}` has shape {shape}, the {role} set {(len(dataset), 2)}")
        return found


class Rollouts:
    """GRPO with num_iterations (mu) > 1: the completions kept between two samplings (train/grpo.py),
    with their rewards, advantages and log-probabilities at sampling time, so a resume between them
    trains on the very completions the run sampled (``rollouts.safetensors``, hashed in the
    manifest; where they start in state.json). A checkpoint at a multiple of mu holds none: the next
    step samples afresh."""

    NAME = "rollouts.safetensors"

    def __init__(self, objective: GRPO, progress: Any):
        self.objective, self.progress = objective, progress

    def state_dict(self) -> dict[str, Any]:
        from safetensors.torch import save as save_tensors

        kept = self.objective.live_kept(self.progress.step)
        if kept is None:
            return {"rollouts": None}
        tensors = {f"r{k}.{name}": t.contiguous() for k, r in enumerate(kept.rollouts) for name, t in r.tensors.items()}
        described = [{"prompts": r.prompts, "groups": r.groups} for r in kept.rollouts]
        return {self.NAME: save_tensors(tensors),
                "rollouts": {"step": kept.step, "position": kept.position, "micro_batches": described}}

    def load_state_dict(self, entries: Mapping[str, Any]) -> None:
        from safetensors.torch import load as load_tensors

        from .grpo import Kept
        from .rollout import Rollout

        saved = getattr(entries, "state", {}).get("rollouts")
        if saved is None:
            self.objective.kept = None
            return
        tensors = load_tensors(entries[self.NAME])
        rollouts = []
        for k, described in enumerate(saved["micro_batches"]):
            prefix = f"r{k}."
            own = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
            rollouts.append(Rollout(own, list(described["prompts"]), int(described["groups"])))
        self.objective.kept = Kept(int(saved["step"]), int(saved["position"]), rollouts)

    def problems(self, entries: Mapping[str, Any], step: int, world_size: int) -> list[str]:
        mu = self.objective.cfg.num_iterations
        if step % mu == 0:
            return []  # the next step samples afresh: nothing kept
        found = state_key_problems(entries, "rollouts", ("step", "position", "micro_batches")) + file_problems(
            entries, self.NAME)
        saved = getattr(entries, "state", {}).get("rollouts")
        if not found and isinstance(saved, dict) and saved.get("step") != step - step % mu:
            found.append(f"state.json `rollouts` were sampled at step {saved.get('step')!r}, not {step - step % mu}")
        return found
