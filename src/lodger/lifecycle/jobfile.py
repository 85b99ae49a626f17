"""Reading a job file: user defaults from $LODGER_HOME/config.toml, data files resolved against
the dataset registry, one ``JobFileError`` that lists every problem; and the commented example
job that `lodger init` writes, generated from the field docstrings.

The models themselves are config.py; this module sits above the ledger (data/registry.py reads it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ..config import (DATASET_PREFIX, USER_ONLY_SECTIONS, USER_SECTIONS, CheckpointConfig, DataConfig,
                     DatasetPolicyConfig, GuardConfig, JobConfig, LimitsConfig, MethodConfig, ModelConfig,
                     PolicyConfig, RemoteConfig, TrainingConfig, check_table, cross_checks, describe, raise_problems,
                     read_toml)
from ..errors import JobFileError
from ..config.tomlfile import toml_value


def _resolve_data(raw: dict[str, Any], base_dir: Path, unregistered: str) -> tuple[dict[str, Any], list[str]]:
    """Each data file that exists (or names a dataset) against the registry: {role: DataUse}, problems."""
    from ..data.registry import list_datasets, resolve

    data = raw.get("data")
    if not isinstance(data, dict):
        data = {}
    wanted = {k: v for k, v in data.items() if k in ("train", "eval") and isinstance(v, str)
              and (v.startswith(DATASET_PREFIX) or (base_dir / v).is_file())}
    if not wanted:
        return {}, []
    registry = list_datasets()
    uses, problems = {}, []
    for role, reference in wanted.items():
        use, found = resolve(role, reference, base_dir, unregistered=unregistered, registry=registry)
        problems += found
        if use is not None:
            uses[role] = use
    return uses, problems


def parse_job(raw: dict[str, Any], source: str, base_dir: Path, *, unregistered: str = "warn") -> JobConfig:
    """Validate an already parsed TOML table; relative data paths are resolved from ``base_dir``,
    `dataset:NAME` through the registry (``unregistered``: "warn" or "strict", the user's policy
    for data files that are not registered datasets)."""
    problems = cross_checks(raw, base_dir)
    uses, data_problems = _resolve_data(raw, base_dir, unregistered)
    problems += data_problems
    try:
        job = JobConfig.model_validate(raw)
    except ValidationError as exc:
        problems += [p for p in map(describe, exc.errors())  # cross_checks named steps/epochs by key
                     if "`steps` or `epochs`" not in p and "give `steps = N`" not in p]
    raise_problems(problems, JobFileError, source, "the job file")
    data = job.data
    data.train = uses["train"].file.path if "train" in uses else (base_dir / data.train).resolve()
    if data.eval is not None:
        data.eval = uses["eval"].file.path if "eval" in uses else (base_dir / data.eval).resolve()
    job.attach_data_uses([uses[role] for role in ("train", "eval") if role in uses])
    source_path = Path(job.model.source).expanduser()
    if not source_path.is_absolute() and (base_dir / source_path).exists():
        job.model.source = str((base_dir / source_path).resolve())
    elif job.model.revision and "@" not in job.model.source and "/" in job.model.source:
        job.model.source = f"{job.model.source}@{job.model.revision}"  # every reader of `source` sees it
    raise_problems(_resolve_reward_files(job, base_dir), JobFileError, source, "the job file")
    if job.method.init_adapter is not None:
        from ..model import apply_init_adapter

        raise_problems(apply_init_adapter(job.method, base_dir), JobFileError, source, "the job file")
    return job


def _resolve_reward_files(job: JobConfig, base_dir: Path) -> list[str]:
    """[[rewards]] files made absolute (from the job file's folder); why any cannot be read. Whether
    the function is there with the right signature is checked by loading it (rewards/, at prepare)."""
    problems = []
    for number, reward in enumerate(job.rewards, 1):
        if reward.file is None:
            continue
        path = (base_dir / Path(reward.file).expanduser()).resolve()
        reward.file = path
        if not path.is_file():
            problems.append(f"[[rewards]] #{number} file = {str(path)!r}: no such file; fix the path (relative "
                            "paths start at the job file's folder)")
        elif path.suffix != ".py":
            problems.append(f"[[rewards]] #{number} file = {str(path)!r}: not a .py file; point it at the Python "
                            "file that defines the function")
    return problems


def user_defaults() -> dict[str, dict[str, Any]]:
    """[policy] and [limits] defaults from $LODGER_HOME/config.toml (validated), plus [agent] and
    [datasets] settings."""
    from ..home import home

    path = home() / "config.toml"
    if not path.is_file():
        return {}
    raw = read_toml(path, "user settings file")
    problems = []
    for section, table in raw.items():
        model = USER_SECTIONS.get(section) or USER_ONLY_SECTIONS.get(section)
        if model is None:
            problems.append(f"[{section}]: unknown section; fix: use [policy], [limits], [datasets] or [agent]")
            continue
        if not isinstance(table, dict):
            problems.append(f"{section} = {table!r}: expected a table; fix: write `[{section}]` with its keys below")
            continue
        check_table(model, table, section, problems)
    raise_problems(problems, JobFileError, str(path), "the user settings")
    return raw


def load_job(path: str | Path, *, use_user_defaults: bool = True) -> JobConfig:
    """Read and validate a job file, raising one JobFileError that lists every problem.

    [policy] and [limits] keys the job leaves out come from $LODGER_HOME/config.toml."""
    path = Path(path)
    raw = read_toml(path, "job file")
    settings = user_defaults()
    if use_user_defaults:
        for section, table in settings.items():
            if section in USER_SECTIONS and isinstance(raw.get(section, {}), dict):
                raw[section] = {**table, **raw.get(section, {})}
    policy = DatasetPolicyConfig.model_validate(settings.get("datasets", {}))
    return parse_job(raw, str(path), path.resolve().parent, unregistered=policy.unregistered)


_COMMENTED_EXAMPLES: dict[str, Any] = {
    "epochs": 1.0, "every_seconds": 600.0, "eval": "eval.jsonl", "max_foreign_memory": 0.8,
    "max_foreign_gpu_memory": 0.5, "allowed_hours": "22:00-07:00", "memory_gb": 8.0,
    "gpu_memory_fraction": 0.8, "max_compute_hours": 10.0, "eval_every": 50, "threads": 2, "steps": 100,
    "revision": "main", "init_adapter": "path/to/adapter", "pack_tokens": 2048, "beta": 0.1,
    "desirable_weight": 1.0, "undesirable_weight": 1.0, "base_bits": 4, "use_dora": True, "use_rslora": True,
    "init_lora": "gaussian"}


REMOTE_EXAMPLE = {"wall_hours": 4.0, "gpu_hours": 4.0, "cost": 10.0, "nodes": 1}


# `lodger init --objective grpo`: settings under which SmolLM2-135M-Instruct's mean reward on the
# bundled prompts rises within minutes on two cores (docs/grpo.md has the measured run).
GRPO_DEMO: dict[str, Any] = {
    "method": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "training": {"steps": 40, "batch_size": 4, "learning_rate": 3e-4, "warmup_steps": 2, "eval_every": 20,
                 "log_every": 1},
    "max_length": 64,
    "grpo": {"num_generations": 4, "max_completion_length": 16},
    "rewards": [{"kind": "python", "file": "verifier.py", "function": "right_number"},
                {"kind": "format", "name": "bare", "pattern": r"-?\d+\.?", "weight": 0.25}]}


def _grpo_sections() -> list[str]:
    """The commented [grpo] section and the demo's [[rewards]] table."""
    from ..config.grpo import GRPOConfig, RewardConfig

    out = ["", f"# {' '.join((JobConfig.model_fields['grpo'].description or '').split())}", "[grpo]"]
    for key, field in GRPOConfig.model_fields.items():
        out.append(f"# {' '.join((field.description or '').split())}")
        if key in GRPO_DEMO["grpo"]:
            out.append(f"{key} = {toml_value(GRPO_DEMO['grpo'][key])}")
        elif field.default is not None:
            out.append(f"# {key} = {toml_value(field.default)}")
        else:
            out.append(f"# {key} = 0.28")
    out += ["", f"# {' '.join((JobConfig.model_fields['rewards'].description or '').split())}",
            "# " + " ".join((RewardConfig.model_fields["kind"].description or "").split())]
    for table in GRPO_DEMO["rewards"]:
        out += ["[[rewards]]"] + [f"{k} = {toml_value(v)}" for k, v in table.items()] + [""]
    out += ['# [[rewards]]', '# kind = "answer"   # the completion\'s last number against the line\'s "answer"',
            "# weight = 1.0"]
    return out


def example_job(train: str = "train.jsonl", eval_: str | None = "eval.jsonl", remote: bool = False,
                objective: str = "sft") -> str:
    """A commented job file, generated from the field docstrings so it never drifts from the code.

    With ``remote`` it ends with a [remote] section whose keys are commented out: a local run
    ignores them; `lodger submit` needs every one. ``objective``: a preference objective's job
    (its keys set, a learning rate and length for pairs)."""
    values: dict[str, dict[str, Any]] = {
        "model": {"source": "smollm2-135m-instruct"},
        "method": {"kind": "lora", "rank": 8, "alpha": 16.0, "dropout": 0.0,
                   "target_modules": ["q_proj", "v_proj"]},
        "data": {"train": train, **({"eval": eval_} if eval_ else {}), "max_length": 128},
        "training": {"steps": 60, "batch_size": 8, "grad_accum": 1, "learning_rate": 1e-3,
                     "warmup_steps": 5, "min_lr_ratio": 0.1, "weight_decay": 0.0, "max_grad_norm": 1.0,
                     "seed": 0, "threads": 2, "eval_every": 20, "log_every": 5},
        "checkpoints": {"keep_last": 3},  # every_seconds = "auto" chooses when
        "guard": {},
        "policy": {},
        "limits": {},
    }
    if objective == "grpo":  # measured on SmolLM2 and this data: docs/grpo.md
        values["method"].update(objective="grpo", **GRPO_DEMO["method"])
        values["training"].update(GRPO_DEMO["training"])
        values["data"]["max_length"] = GRPO_DEMO["max_length"]
    elif objective != "sft":
        from ..config.model import PREFERENCE_DEFAULTS

        values["method"].update(objective=objective, **PREFERENCE_DEFAULTS[objective])
        values["training"].update(steps=40, batch_size=4, learning_rate=5e-4, eval_every=10)
    sections: dict[str, type[BaseModel]] = {"model": ModelConfig, "method": MethodConfig, "data": DataConfig,
                "training": TrainingConfig, "checkpoints": CheckpointConfig, "guard": GuardConfig,
                "policy": PolicyConfig,
                "limits": LimitsConfig}
    out = ["# lodger job file. Every key is optional unless marked required; run `lodger run FILE`.",
           "", "# " + (JobConfig.model_fields["name"].description or ""), 'name = "my-job"']
    for section, model in sections.items():
        out += ["", f"# {JobConfig.model_fields[section].description}", f"[{section}]"]
        for key, field in model.model_fields.items():
            doc = (field.description or "").replace("\n", " ")
            doc = " ".join(doc.split())
            required = " (required)" if field.is_required() else ""
            out.append(f"# {doc}{required}")
            if key in values[section]:
                out.append(f"{key} = {toml_value(values[section][key])}")
            elif field.default is not None and not field.is_required():
                out.append(f"# {key} = {toml_value(field.default)}")
            else:
                out.append(f"# {key} = {toml_value(_COMMENTED_EXAMPLES[key])}")
    if objective == "grpo":
        out += _grpo_sections()
    if remote:
        doc = " ".join((RemoteConfig.__doc__ or "").split())
        out += ["", f"# {doc} Uncomment and set every key before `lodger submit FILE --target T` "
                "(docs/boundary.md).", "[remote]"]
        for key, field in RemoteConfig.model_fields.items():
            out += [f"# {' '.join((field.description or '').split())}", f"# {key} = {toml_value(REMOTE_EXAMPLE[key])}"]
    return "\n".join(out) + "\n"
