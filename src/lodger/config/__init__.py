"""The job file's typed, documented models, and how a problem in one is described.

Defaults live here and only here. Reading a job file (user defaults, registered datasets, one
``JobFileError`` listing every problem) is lifecycle/jobfile.py, which sits above the ledger; this module
imports nothing of lodger but errors, so anything may read a job's shape. One module per group of
sections (model.py, training.py, owner.py, remote.py); this one joins them into the job.
"""

from __future__ import annotations

import difflib
import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, TypeVar

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from ..errors import JobFileError, LodgerError
from .base import Float, Int, Section  # noqa: F401 (the sections' vocabulary, used by other config files)
from .grpo import GRPOConfig, RewardConfig
from .model import DataConfig, MethodConfig, ModelConfig
from .owner import USER_ONLY_SECTIONS, USER_SECTIONS, AgentSettings, DatasetPolicyConfig, LimitsConfig, PolicyConfig  # noqa: F401
from .remote import FederatedConfig, FederatedPrivacyConfig, RemoteConfig  # noqa: F401
from .report import ReportConfig
from .training import CheckpointConfig, GuardConfig, TrainingConfig


class JobConfig(Section):
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """Output name: the run id starts with it. Letters, digits, `_`, `.`, `-`."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The base model."""
    method: MethodConfig = Field(default_factory=MethodConfig)
    """What is trained: a LoRA adapter or all weights."""
    data: DataConfig
    """Where the examples come from."""
    training: TrainingConfig
    """Optimisation settings."""
    checkpoints: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """How often state is committed to disk."""
    guard: GuardConfig = Field(default_factory=GuardConfig)
    """What happens when numbers go bad (NaN/Inf losses, spikes)."""
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    """When the run yields the machine to its owner (defaults: [policy] in $LODGER_HOME/config.toml)."""
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    """Resource limits, enforced and recorded (defaults: [limits] in $LODGER_HOME/config.toml)."""
    remote: RemoteConfig = Field(default_factory=RemoteConfig)
    """Limits that must be declared before the job may move to remote compute (`lodger submit`)."""
    federated: FederatedConfig | None = None
    """Present: the job runs as a federated Flower app (`lodger federate`, `lodger submit --federated`)."""
    report: ReportConfig = Field(default_factory=ReportConfig)
    """Trackers the run's numbers go to while it trains (TensorBoard, MLflow, Trackio; docs/ui.md)."""
    grpo: GRPOConfig | None = None
    """[method] objective = "grpo" only: how completions are sampled and the loss is taken (left out: the defaults)."""
    rewards: list[RewardConfig] = Field(default_factory=list)
    """[method] objective = "grpo" only: the reward functions, one [[rewards]] table each (at least one)."""

    # What each data file is (lodger.data.registry.DataUse: hash, registration), found at load time.
    _data_uses: list = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _federated_is_lora(self) -> "JobConfig":
        if self.federated is not None and self.method.kind != "lora":
            raise ValueError("[federated] needs [method] kind = \"lora\": federated rounds send the trained "
                             "weights every round, and full weights are the whole model (too large to move "
                             "each round, and they reveal more of the data); use kind = \"lora\"")
        if self.federated is not None and self.method.objective != "sft":
            raise ValueError(f"[federated] with [method] objective = \"{self.method.objective}\": federated rounds "
                             "train supervised (sft) only, since each client's reference log-probabilities would "
                             "have to follow the global adapter of every round; remove [federated] or use "
                             "objective = \"sft\"")
        return self

    @model_validator(mode="after")
    def _quantised_base_alone(self) -> "JobConfig":
        bits = self.method.base_bits
        if bits is not None and self.federated is not None:
            raise ValueError(f"[method] base_bits = {bits} with [federated]: federated clients are not yet checked "
                             "to quantise their bases alike; remove base_bits, or [federated]")
        if bits is not None and self.training.world_size > 1:
            raise ValueError(f"[method] base_bits = {bits} with [training] world_size = {self.training.world_size}: "
                             "data-parallel training on a quantised base is not checked yet; use world_size = 1, "
                             "or remove base_bits")
        return self

    @model_validator(mode="after")
    def _grpo_parts(self) -> "JobConfig":
        grpo = self.method.objective == "grpo"
        if not grpo and (self.grpo is not None or self.rewards):
            what = "[grpo]" if self.grpo is not None else "[[rewards]]"
            raise ValueError(f'{what} is used only with [method] objective = "grpo" (this job\'s is '
                             f'"{self.method.objective}"): remove it, or set objective = "grpo"')
        if not grpo:
            return self
        if not self.rewards:
            raise ValueError('[method] objective = "grpo" needs at least one [[rewards]] table, e.g.\n'
                             '    [[rewards]]\n    kind = "answer"   # the last number of the completion against '
                             'the line\'s "answer"')
        if self.grpo is None:
            self.grpo = GRPOConfig()
        if self.training.packing is True:
            raise ValueError('[training] packing = true with objective = "grpo": a GRPO step trains on completions '
                             'it has just sampled, padded per prompt group; set packing = false (or leave it out)')
        if self.grpo.num_iterations > 1 and self.training.world_size > 1:
            raise ValueError("[grpo] num_iterations > 1 with [training] world_size > 1: each rank's kept completions "
                             "would have to go into every checkpoint, which lodger does not do yet; use "
                             "num_iterations = 1 or world_size = 1")
        labels = [r.label() for r in self.rewards]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise ValueError(f"[[rewards]]: two rewards are named {twice[0]!r}; give each a distinct `name`")
        for reward in self.rewards:
            if reward.kind == "length" and reward.target is not None \
                    and reward.target >= self.grpo.max_completion_length:
                raise ValueError(f"[[rewards]] {reward.label()}: target = {reward.target} is not below [grpo] "
                                 f"max_completion_length = {self.grpo.max_completion_length}, so it never penalises; "
                                 "lower it")
        return self

    def resolved_dict(self) -> dict[str, Any]:
        """The job with every default filled in, as plain TOML-ready values."""
        return self.model_dump(mode="json", exclude_none=True)

    def data_uses(self) -> list:
        """The job's data files as ``lodger.data.registry.DataUse`` (role, hash, registered dataset or
        None), resolved when the job was loaded."""
        return list(self._data_uses)

    def attach_data_uses(self, uses: list) -> None:
        """Set by the job loader (lifecycle/jobfile.py) once the data files are resolved."""
        self._data_uses = list(uses)


def _fix_for(error: Mapping[str, Any], model_fields: dict[str, Any]) -> str:
    kind = error["type"]
    key = str(error["loc"][-1]) if error["loc"] else ""
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(key, list(model_fields), n=1)
        hint = f"did you mean `{close[0]}`? " if close else ""
        return f"{hint}remove it (known keys: {', '.join(sorted(model_fields))})"
    if kind == "missing":
        return "add it"
    if kind == "literal_error":
        return "use one of the allowed values"
    return _TYPE_FIXES.get(kind, "change the value")


_TYPE_FIXES = {
    "int_type": "write a whole number without quotes (e.g. 4)", "float_type": "write a number without quotes (e.g. 0.5)",
    "string_type": "write it as a string in quotes", "bool_type": "write true or false (without quotes)",
    "list_type": "write a list, e.g. [\"a\", \"b\"]", "finite_number": "write a finite number (not nan or inf)",
    "dict_type": "write it as a table [section] with its keys below", "model_type": "write it as a table [section] "
    "with its keys below", "greater_than": "use a larger value", "greater_than_equal": "use a larger value",
    "less_than": "use a smaller value", "less_than_equal": "use a smaller value"}  # pydantic's error kinds


def _section_fields(loc: tuple[Any, ...], model: type[BaseModel] | None = None) -> dict[str, Any]:
    model = model or JobConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
        else:
            break
    return model.model_fields


def describe(error: Mapping[str, Any], model: type[BaseModel] | None = None) -> str:
    """One problem as `[section] key = value: reason; fix: ...` (``loc`` starts in ``model``, default the job)."""
    loc = tuple(error["loc"])
    section = ".".join(str(p) for p in loc[:-1])
    key = f"[{section}] {loc[-1]}" if section else (str(loc[-1]) if loc else "(file)")
    if error["type"] == "missing":
        where = f"[{section}] " if section else ""
        annotation = getattr(_section_fields(loc, model).get(str(loc[-1])) if loc else None, "annotation", None)
        if not section and isinstance(annotation, type) and issubclass(annotation, BaseModel):
            needs = _SECTION_NEEDS.get(str(loc[-1])) or ", ".join(
                f"{k} = ..." for k, f in annotation.model_fields.items() if f.is_required())
            return f"[{loc[-1]}]: missing section; add it" + (f" with {needs}" if needs else "")
        return f"{where}{loc[-1]}: missing; add it" if loc else "missing value"
    value = error.get("input")
    shown = "" if isinstance(value, dict) else f" = {value!r}"
    message = error["msg"].removeprefix("Value error, ")
    return f"{key}{shown}: {message}; fix: {_fix_for(error, _section_fields(loc, model))}"



Model = TypeVar("Model", bound=BaseModel)


def check_table(model: type[Model], table: dict[str, Any], where: str, problems: list[str]) -> Model | None:
    """``table`` as ``model``; or None, with every problem pydantic found added to ``problems``, each as
    `[where] key = value: reason; fix: ...` (``where``: the table's name in its file)."""
    try:
        return model.model_validate(table)
    except ValidationError as exc:
        problems += [f"[{where}] " + describe(e, model).removeprefix("[") for e in exc.errors()]
        return None


def raise_problems(problems: list[str], error: Callable[[str], LodgerError], where: str, what: str) -> None:
    """Raise ``error`` listing every one of ``problems`` (none: nothing to raise), so the owner fixes
    the file in one go: `WHERE: N problem(s) in WHAT:` and a line each."""
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise error(f"{where}: {len(problems)} problem(s) in {what}:\n{listed}")

# What a missing section needs at least, for the error that says it is missing.
_SECTION_NEEDS = {"data": 'train = "FILE.jsonl"', "training": "steps = N (or epochs = N)"}


def cross_checks(raw: dict[str, Any], base_dir: Path) -> list[str]:
    """Problems pydantic would report only once every field is valid; checked on the raw table so
    they are listed together with everything else."""
    problems = []
    training = raw.get("training")
    if not isinstance(training, dict):
        training = {}
    if "steps" in training and "epochs" in training:
        problems.append(f"[training] steps = {training['steps']!r} and epochs = {training['epochs']!r}: "
                        "give either `steps` or `epochs`, not both; fix: remove one of them")
    elif isinstance(raw.get("training"), dict) and "steps" not in training and "epochs" not in training:
        problems.append("[training] steps: missing; add `steps = N` or `epochs = N`")
    data = raw.get("data")
    if not isinstance(data, dict):
        data = {}
    for key in ("train", "eval"):
        if isinstance(data.get(key), str) and data[key].startswith(DATASET_PREFIX):
            continue  # resolved through the registry (lifecycle/jobfile.py)
        if isinstance(data.get(key), str) and not (base_dir / data[key]).is_file():
            path = base_dir / data[key]
            if path.exists():  # a FIFO would block the read forever, a device never end
                kind = "a folder" if path.is_dir() else "not a regular file (a named pipe, a device or a socket)"
                problems.append(f"[data] {key} = {data[key]!r}: {path.resolve()} is {kind}; fix: point it at a "
                                "JSONL file")
                continue
            problems.append(f"[data] {key} = {data[key]!r}: file not found at {path.resolve()}; "
                            "fix the path (relative paths start at the job file's folder)")
    return problems


DATASET_PREFIX = "dataset:"


def read_toml(path: Path, what: str) -> dict[str, Any]:
    try:
        text = (raw := path.read_bytes()).decode("utf-8")
    except FileNotFoundError:
        raise JobFileError(f"{path}: no such {what}; create one with `lodger init {path}`") from None
    except OSError as exc:
        raise JobFileError(f"{path}: cannot read the {what}: {exc}") from None
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise JobFileError(f"{path}: cannot read the {what}: line {line} is not valid UTF-8 (byte "
                           f"0x{raw[exc.start]:02x}); save the file as UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise JobFileError(f"{path}: not valid TOML: {exc}; fix the syntax at that line") from None


def total_steps(job: JobConfig, n_train: int) -> int:
    """Optimizer steps the job will take, from `steps` or from `epochs` over ``n_train`` examples."""
    if job.training.steps is not None:
        return job.training.steps
    assert job.training.epochs is not None  # TrainingConfig requires `steps` or `epochs`
    per_step = job.training.batch_size * job.training.grad_accum * job.training.world_size  # all ranks' examples
    return epoch_steps(job.training.epochs * n_train, n_train, per_step)


def epoch_steps(examples: float, n_train: int, per_step: int) -> int:
    """Steps that draw ``examples`` sampler positions when a step takes ``per_step`` of them and
    ends early at the end of each epoch of ``n_train`` (data/packing.py): whole epochs, then the rest."""
    full, rest = divmod(examples, n_train)
    rest = round(rest, 6)  # 0.3 x 10 is 3.0000000000000004 positions, not 4 steps of 1
    return max(1, int(full) * math.ceil(n_train / per_step) + math.ceil(rest / per_step))


def job_hash(job: JobConfig) -> str:
    """The identity of a job: sha256 of its resolved settings (recorded with every run of it)."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(job.resolved_dict(), sort_keys=True).encode()).hexdigest()
