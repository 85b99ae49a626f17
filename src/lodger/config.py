"""The job file's typed, documented models, and how a problem in one is described.

Defaults live here and only here. Reading a job file (user defaults, registered datasets, one
``JobFileError`` listing every problem) is jobfile.py, which sits above the ledger; this module
imports nothing of lodger but errors, so anything may read a job's shape.
"""

from __future__ import annotations

import difflib
import math
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, Strict, field_validator, model_validator

from .errors import JobFileError


# TOML has real numbers and booleans: `batch_size = true` is a mistake, not the number 1.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ModelConfig(Section):
    source: str = Field("smollm2-135m-instruct", min_length=1)
    """The base model: the alias `smollm2-135m-instruct`, a local Hugging Face folder (config.json +
    safetensors), a .gguf file, or a hub id (`org/name`, `org/name@revision`) already in the local
    Hugging Face cache (HF_HUB_CACHE / HF_HOME). Nothing is ever downloaded."""
    revision: str | None = None
    """For a hub id: the branch, tag or commit of the cached snapshot to use (default `main`)."""


class MethodConfig(Section):
    kind: Literal["lora", "full"] = "lora"
    """`lora` trains a small adapter (peft); `full` trains every weight of the model."""
    rank: Int = Field(8, ge=1, le=1024)
    """LoRA rank r: the width of the low-rank update."""
    alpha: Float = Field(16.0, gt=0)
    """LoRA alpha: the update is scaled by alpha / rank."""
    dropout: Float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA input during training (0 disables it)."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], min_length=1)
    """Names of the linear layers that get an adapter, e.g. ["q_proj", "k_proj", "v_proj", "o_proj"]."""
    init_adapter: Path | None = None
    """Continue training this existing peft adapter folder (adapter_config.json +
    adapter_model.safetensors) instead of a fresh one; rank, alpha and target_modules are read from
    it (left out here, or equal)."""


class DataConfig(Section):
    train: Path
    """Training data: JSONL, one `{"messages": [...]}` chat or `{"text": ...}` per line; a path
    (relative paths are taken from the job file's folder) or `dataset:NAME`, a dataset registered
    with `lodger data add`."""
    eval: Path | None = None
    """Held-out data in the same format (a path or `dataset:NAME`). When absent, `eval_fraction`
    of `train` is held out."""
    eval_fraction: Float = Field(0.1, ge=0.0, lt=1.0)
    """Share of the training lines held out for evaluation when `eval` is not given (0 disables eval)."""
    max_length: Int = Field(256, ge=8, le=131072)
    """Tokens per example; longer examples are truncated."""


class TrainingConfig(Section):
    steps: Int | None = Field(None, ge=1)
    """Number of optimizer steps. Give either `steps` or `epochs`."""
    epochs: Float | None = Field(None, gt=0)
    """Passes over the training data (may be fractional). Give either `steps` or `epochs`."""
    batch_size: Int = Field(4, ge=1)
    """Examples per micro-batch (one forward and backward pass)."""
    grad_accum: Int = Field(1, ge=1)
    """Micro-batches accumulated into one optimizer step; the effective batch is batch_size * grad_accum."""
    learning_rate: Float = Field(2e-4, gt=0, le=1.0)
    """Peak learning rate of AdamW, reached after warmup."""
    warmup_steps: Int = Field(0, ge=0)
    """Steps of linear warmup from 0 to `learning_rate`."""
    min_lr_ratio: Float = Field(0.1, ge=0.0, le=1.0)
    """After warmup the rate follows a cosine down to learning_rate * min_lr_ratio at the end of training."""
    weight_decay: Float = Field(0.0, ge=0.0)
    """AdamW decoupled weight decay."""
    max_grad_norm: Float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: Int = Field(0, ge=0, lt=2**63)
    """Seeds the adapter's initial weights, dropout, the eval split and the data order."""
    threads: Int | None = Field(None, ge=1, le=1024)
    """CPU threads for torch. Left out, lodger uses every core and records the number it chose;
    results are bitwise comparable only at the same thread count."""
    world_size: Int = Field(1, ge=1, le=1024)
    """Training processes, data parallel through torchrun (gloo on CPU, nccl on GPU); each takes
    `batch_size` examples per micro-batch, so one optimizer step sees batch_size * grad_accum *
    world_size examples. Each process uses `threads` threads. A run resumes only with the number
    of processes that wrote its checkpoint."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: `auto` uses the GPU when there is one."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision: `bf16` autocast (CPU or GPU), `fp16` autocast with dynamic loss scaling (GPU
    only). Trainable weights and optimizer state always stay fp32."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: much less memory, about a third more time."""
    eval_every: Int | None = Field(None, ge=1)
    """Evaluate on the held-out set every this many steps (and always at the start and the end)."""
    log_every: Int = Field(1, ge=1)
    """Print the step line every this many steps (every step is still written to metrics.jsonl)."""
    packing: Literal["auto"] | bool = "auto"
    """Padding-free batches: lay each micro-batch's examples into rows of `pack_tokens` tokens
    (by default one row holding the whole micro-batch, no padding at all), with position ids
    restarting per example and attention that never crosses examples. A step holds the same
    examples as unpacked (same step count, same loss per target token); only the padding goes.
    `auto` packs when the unpacked micro-batches would hold padding (1 % on the CPU, where packed
    attention runs per example; 10 % on a GPU; known from the example lengths before training) and the model
    keeps packed examples apart (probed at start); both go in the provenance. `true` always packs; `false` never."""
    order: Literal["shuffle", "length_grouped"] = "shuffle"
    """Which examples share a step: `shuffle` draws them in a seeded random order;
    `length_grouped` draws examples of similar length together (random megabatches of 50 steps'
    examples sorted by length, as the Hugging Face Trainer's `group_by_length`): far less padding
    and shorter attention rows, so faster on uneven data, but each step's examples are no longer a
    uniform sample. Either is a pure function of seed, epoch and position (exact resume); `packing`
    applies to either (docs/packing.md)."""
    pack_tokens: Int | None = Field(None, ge=1)
    """Token budget of one packed row; left out, batch_size x max_length (one row per
    micro-batch, no padding). At least max_length; smaller rows mean several rows per
    micro-batch, padded to the widest, and less attention work per token with dense attention."""

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> "TrainingConfig":
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give either `steps` or `epochs`, not both: remove one of them")
        if self.steps is None and self.epochs is None:
            raise ValueError("give `steps = N` or `epochs = N` in [training]")
        return self


class GuardConfig(Section):
    skip_nonfinite: bool = True
    """Skip the optimizer step (nothing is updated) when the loss or gradient norm is NaN or Inf."""
    max_bad_steps: Int = Field(3, ge=1)
    """After this many skipped steps in a row, roll back to the last good checkpoint."""
    lr_factor: Float = Field(0.5, gt=0, le=1)
    """After a rollback the learning rate is multiplied by this factor."""
    max_rollbacks: Int = Field(3, ge=0)
    """After this many rollbacks the run stops with a report."""
    spike_zscore: Float = Field(6.0, gt=0)
    """A loss this many robust standard deviations (median/MAD) above the recent window is a spike (recorded)."""
    spike_window: Int = Field(50, ge=5)
    """How many recent steps the spike detector looks at."""


class CheckpointConfig(Section):
    every_steps: Int = Field(0, ge=0)
    """Also commit a checkpoint every this many optimizer steps (0, the default: by time, on stop and
    at the end). A number of steps is a guess at a time that depends on the model and machine;
    every_seconds = "auto" makes the choice."""
    every_seconds: Float | Literal["auto"] = "auto"
    """Also commit one when this many seconds have passed since the last (checked at step boundaries);
    0: never by time. "auto" (the default) chooses the interval that loses least: Young/Daly's
    optimum from this run's measured checkpoint cost and the unplanned interruptions (crashes,
    kills, power cuts) this machine's ledger has seen, with a prior of one a day when there is no
    history; re-chosen after each checkpoint and recorded as `checkpoint_interval` events (`lodger
    show` prints it). The default, because a number here is a guess and a wrong guess costs either
    saving time or lost work; every_steps (off by default) adds step-based saves on top."""
    keep_last: Int = Field(3, ge=2)
    """How many committed checkpoints to keep (at least 2, so a damaged newest one has a fallback)."""

    @field_validator("every_seconds", mode="before")
    @classmethod
    def _seconds_or_auto(cls, value: Any) -> Any:
        if value == "auto" and isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
            return float(value)
        raise ValueError('must be "auto" (lodger chooses it), a number of seconds, or 0 for no time-based '
                         'checkpoints (e.g. every_seconds = 600)')


class PolicyConfig(Section):
    enabled: bool = True
    """Let `lodger agent` pause this run by the rules below (and let `lodger serve` hold it)."""
    max_foreign_cpu: Float | None = Field(0.5, gt=0, le=1)
    """Yield while other processes use more than this share of all CPU cores (0-1)."""
    max_foreign_memory: Float | None = Field(None, gt=0, le=1)
    """Yield while other processes use more than this share of the machine's memory (0-1)."""
    max_foreign_gpu_memory: Float | None = Field(None, gt=0, le=1)
    """Yield while other processes use more than this share of GPU memory (0-1; needs a GPU)."""
    pause_on_battery: bool = True
    """Yield while the machine runs on battery."""
    allowed_hours: str | None = Field(None, pattern=r"^\d{2}:\d{2}-\d{2}:\d{2}$")
    """Train only inside these hours, e.g. "22:00-07:00" (may wrap midnight); outside them, yield."""
    clear_seconds: Float = Field(10.0, ge=0)
    """Continue once every condition has been clear for this many seconds."""
    yield_mode: Literal["hold", "release"] = "hold"
    """How to yield: `hold` keeps memory and stops using CPU; `release` checkpoints and exits."""
    yield_to_inference: bool = True
    """Hold while `lodger serve` answers requests (and for the grace period after)."""
    inference_grace_seconds: Float = Field(3.0, ge=0)
    """How long after the last inference request the run stays held."""


class LimitsConfig(Section):
    nice: Int = Field(10, ge=0, le=19)
    """CPU priority (nice value): higher is kinder to the owner's other work."""
    ionice_idle: bool = True
    """Use the idle I/O class, so checkpoints never slow the owner's disk work."""
    memory_gb: Float | None = Field(None, gt=0)
    """Memory ceiling (resident set, GiB): the run commits a checkpoint and stops before reaching it."""
    gpu_memory_fraction: Float | None = Field(None, gt=0, le=1)
    """Largest share of GPU memory the run may allocate."""
    max_compute_hours: Float | None = Field(None, gt=0)
    """Total CPU hours (over all segments) after which the run checkpoints and stops."""


class RemoteConfig(Section):
    """Explicit limits for remote compute. `lodger submit` refuses a job without them; a local run
    ignores them. The remote job enforces them itself: it commits a checkpoint and stops at each."""

    wall_hours: Float | None = Field(None, gt=0)
    """Wall-clock hours the remote job may run (over all its segments)."""
    gpu_hours: Float | None = Field(None, ge=0)
    """GPU hours it may use in total (wall hours x GPUs; 0 for a CPU-only job)."""
    cost: Float | None = Field(None, ge=0)
    """Most it may cost, in the target's currency (GPU hours x the target's cost per GPU hour)."""
    nodes: Int | None = Field(None, ge=1)
    """Machines it may use at once."""


class FederatedPrivacyConfig(Section):
    """[federated.privacy]: optional update protection that Flower provides, recorded with the run."""

    clip_norm: Float | None = Field(None, gt=0)
    """Clip each client's adapter update (its adapter minus the round's global one, all tensors
    together) to this L2 norm before it leaves, with Flower's `fixedclipping_mod` on the client (or
    Flower's `LocalDpMod` when `local_epsilon` is set); left out, updates are not clipped."""
    noise_multiplier: Float = Field(0.0, ge=0)
    """Central differential privacy (Flower's client-side fixed clipping recipe): the server adds
    Gaussian noise to each round's aggregate with standard deviation noise_multiplier * clip_norm *
    the largest client's FedAvg weight (clip_norm / n for n equal clients, Flower's `compute_stdv`).
    The server sees each clipped update without noise. 0 adds none. Needs `clip_norm`."""
    local_epsilon: Float | None = Field(None, gt=0)
    """Local differential privacy: each client adds Gaussian noise to its clipped update before it
    leaves, with Flower's `LocalDpMod` (sensitivity clip_norm, this epsilon and `local_delta`), so
    the server never sees an update without noise. Needs `clip_norm` and `local_delta`."""
    local_delta: Float | None = Field(None, gt=0, lt=1)
    """The delta of `local_epsilon` (the chance the guarantee fails), e.g. 1e-5."""
    secure_aggregation: bool = False
    """Flower's SecAgg+ (`SecAggPlusWorkflow`, `secaggplus_mod`): clients send masked, quantized
    updates and the server can unmask only their token-weighted sum (docs/federated.md)."""
    secagg_num_shares: Int | Float = Field(1.0, gt=0)
    """SecAgg+ `num_shares`: a float is the fraction of the round's clients each client shares its
    secrets with (1.0: all of them), an int (> 2) the number."""
    secagg_reconstruction_threshold: Int | Float = Field(0.5, gt=0)
    """SecAgg+ `reconstruction_threshold`: shares needed to rebuild a secret (a float: that fraction
    of num_shares; never below 2). Higher is more private, lower survives more dropped clients."""
    secagg_clipping_range: Float = Field(8.0, gt=0)
    """SecAgg+ `clipping_range`: adapter values must lie in [-range, range] to be quantized (a client
    whose adapter does not is refused, never silently clipped); smaller is more precise."""
    secagg_quantization_range: Int = Field(4194304, gt=1, lt=2**31)
    """SecAgg+ `quantization_range`: quantization levels over [-clipping_range, clipping_range]."""

    @model_validator(mode="after")
    def _noise_needs_clip(self) -> "FederatedPrivacyConfig":
        if (self.noise_multiplier > 0 or self.local_epsilon is not None) and self.clip_norm is None:
            raise ValueError("noise_multiplier and local_epsilon need clip_norm (the noise is scaled by it): add "
                             "`clip_norm = ...`")
        if (self.local_epsilon is None) != (self.local_delta is None):
            raise ValueError("local_epsilon and local_delta go together (Flower's LocalDpMod needs both): add the "
                             "missing one, e.g. `local_delta = 1e-5`")
        return self


class FederatedConfig(Section):
    """[federated]: train one adapter across owners' machines with Flower; each owner's data stays
    on its machine and only adapter tensors, a token count and metrics leave it."""

    rounds: Int = Field(3, ge=1, le=100000)
    """Rounds of federated training: each round the server sends the global adapter, the sampled
    clients train `local_steps` steps on their own data and send their adapters back."""
    local_steps: Int = Field(1, ge=1)
    """Optimizer steps each client takes per round (with [training] batch_size and grad_accum);
    [training] steps/epochs are not used by a federated run."""
    min_clients: Int = Field(2, ge=1)
    """Clients that must be connected before a round starts, and must answer for it to count."""
    clients_per_round: Int | None = Field(None, ge=1)
    """Clients sampled each round (the first ones by client id after a seeded shuffle); left out, all
    connected clients take part."""
    aggregation: Literal["fedavg"] = "fedavg"
    """How adapters are combined: `fedavg`, the mean weighted by each client's target tokens,
    summed in float64 in client-id order (bitwise reproducible)."""
    round_timeout_seconds: Float = Field(3600.0, gt=0)
    """How long the server waits for a round's replies; clients that have not answered by then are
    left out of that round."""
    interrupted_client: Literal["finish", "drop"] = "finish"
    """A client killed mid-round: `finish` completes the local steps already paid for from its local
    checkpoint when it rejoins and sends that work with the next round; `drop` discards it."""
    privacy: FederatedPrivacyConfig = Field(default_factory=FederatedPrivacyConfig)
    """Optional update protection (clipping with Gaussian noise; secure aggregation)."""

    @model_validator(mode="after")
    def _sampled_at_least_min(self) -> "FederatedConfig":
        if self.clients_per_round is not None and self.clients_per_round < self.min_clients:
            raise ValueError(f"clients_per_round ({self.clients_per_round}) is below min_clients "
                             f"({self.min_clients}): no round could count; raise it or lower min_clients")
        return self


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

    # What each data file is (lodger.datasets.DataUse: hash, registration), found at load time.
    _data_uses: list = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _federated_is_lora(self) -> "JobConfig":
        if self.federated is not None and self.method.kind != "lora":
            raise ValueError("[federated] needs [method] kind = \"lora\": federated rounds send the trained "
                             "weights every round, and full weights are the whole model (too large to move "
                             "each round, and they reveal more of the data); use kind = \"lora\"")
        return self

    def resolved_dict(self) -> dict[str, Any]:
        """The job with every default filled in, as plain TOML-ready values."""
        return self.model_dump(mode="json", exclude_none=True)

    def data_uses(self) -> list:
        """The job's data files as ``lodger.datasets.DataUse`` (role, hash, registered dataset or
        None), resolved when the job was loaded."""
        return list(self._data_uses)

    def attach_data_uses(self, uses: list) -> None:
        """Set by the job loader (jobfile.py) once the data files are resolved."""
        self._data_uses = list(uses)


def _fix_for(error: dict[str, Any], model_fields: dict[str, Any]) -> str:
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


def describe(error: dict[str, Any], model: type[BaseModel] | None = None) -> str:
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


# What a missing section needs at least, for the error that says it is missing.
_SECTION_NEEDS = {"data": 'train = "FILE.jsonl"', "training": "steps = N (or epochs = N)"}


def cross_checks(raw: dict[str, Any], base_dir: Path) -> list[str]:
    """Problems pydantic would report only once every field is valid; checked on the raw table so
    they are listed together with everything else."""
    problems = []
    training = raw.get("training") if isinstance(raw.get("training"), dict) else {}
    if "steps" in training and "epochs" in training:
        problems.append(f"[training] steps = {training['steps']!r} and epochs = {training['epochs']!r}: "
                        "give either `steps` or `epochs`, not both; fix: remove one of them")
    elif isinstance(raw.get("training"), dict) and "steps" not in training and "epochs" not in training:
        problems.append("[training] steps: missing; add `steps = N` or `epochs = N`")
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    for key in ("train", "eval"):
        if isinstance(data.get(key), str) and data[key].startswith(DATASET_PREFIX):
            continue  # resolved through the registry (jobfile.py)
        if isinstance(data.get(key), str) and not (base_dir / data[key]).is_file():
            problems.append(f"[data] {key} = {data[key]!r}: file not found at {(base_dir / data[key]).resolve()}; "
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


class DatasetPolicyConfig(Section):
    """[datasets] in $LODGER_HOME/config.toml: the user's rules for data files."""

    unregistered: Literal["warn", "strict"] = "warn"
    """A data file that is not a registered dataset: `warn` trains locally, warns and records it;
    `strict` refuses the job (register the file with `lodger data add`)."""


class AgentSettings(Section):
    """[agent] in $LODGER_HOME/config.toml: how `lodger agent` shares the machine between runs."""

    max_concurrent: Int = Field(1, ge=1, le=1024)
    """Runs trained side by side at most (when their threads fit); `lodger agent --max-concurrent` overrides it."""


USER_SECTIONS = {"policy": PolicyConfig, "limits": LimitsConfig}
"""Sections of config.toml whose keys are defaults for the job's sections of the same name."""
USER_ONLY_SECTIONS = {"datasets": DatasetPolicyConfig, "agent": AgentSettings}
"""Sections of config.toml that are the user's own settings, not job defaults."""


def total_steps(job: JobConfig, n_train: int) -> int:
    """Optimizer steps the job will take, from `steps` or from `epochs` over ``n_train`` examples."""
    if job.training.steps is not None:
        return job.training.steps
    per_step = job.training.batch_size * job.training.grad_accum * job.training.world_size  # all ranks' examples
    return epoch_steps(job.training.epochs * n_train, n_train, per_step)


def epoch_steps(examples: float, n_train: int, per_step: int) -> int:
    """Steps that draw ``examples`` sampler positions when a step takes ``per_step`` of them and
    ends early at the end of each epoch of ``n_train`` (packing.py): whole epochs, then the rest."""
    full, rest = divmod(examples, n_train)
    rest = round(rest, 6)  # 0.3 x 10 is 3.0000000000000004 positions, not 4 steps of 1
    return max(1, int(full) * math.ceil(n_train / per_step) + math.ceil(rest / per_step))


def job_hash(job: JobConfig) -> str:
    """The identity of a job: sha256 of its resolved settings (recorded with every run of it)."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(job.resolved_dict(), sort_keys=True).encode()).hexdigest()
