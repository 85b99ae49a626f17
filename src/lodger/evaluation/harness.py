"""EleutherAI's lm-evaluation-harness (`lm-eval`) on a model lodger loaded: tasks, hashes, scores.

Tasks are found by lm-eval's ``TaskManager``: lodger's own tiny set (``demo/tasks/``, the
``lodger_demo`` tag), any folder of task YAML files the user names, and, only when a name is in
neither (indexing them takes seconds), lm-eval's built-in tasks. Nothing is downloaded
(``HF_DATASETS_OFFLINE=1``): a task whose data is not in the local datasets cache is an error that
names the task, its dataset and how to make it available.

What a score is worth is recorded with it: per task a sha256 of its resolved configuration (prompt
templates, metrics, the source of any function it uses) and of every document it evaluates on, the
number of samples, and each metric with its standard error. No torch at import.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import EvalError

HARNESS = "lm-eval"
TASKS_DIR = Path(__file__).resolve().parents[1] / "demo" / "tasks"
DEFAULT_TASKS = ("lodger_demo",)
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")  # dataset_path values that read local data_files
INSTALL_HINT = "install it with `pip install 'lodger[eval]'` (or `pip install lm-eval==0.4.13`)"


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def sha256_json(value: Any) -> str:
    return hashlib.sha256(_canonical(value).encode()).hexdigest()


def offline() -> None:
    """lodger never downloads: datasets and the hub are told so before either is imported."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.ERROR)


def harness_version() -> str:
    """The installed lm-eval's version; a clear error when it is not installed."""
    offline()
    try:
        import lm_eval
    except ImportError:
        raise EvalError(f"`lodger eval` runs EleutherAI's lm-evaluation-harness, which is not installed: "
                        f"{INSTALL_HINT}") from None
    return str(lm_eval.__version__)


@dataclass
class TaskSet:
    """The tasks of one evaluation, loaded once and scored for every model."""

    names: list[str]                        # as asked for
    objects: list = field(repr=False)       # what lm-eval evaluates (tasks and groups)
    tasks: dict[str, dict]                  # leaf task name -> {"version", "config_sha256", "data_sha256", "docs", ...}
    groups: list[str]
    manager: Any = field(default=None, repr=False)  # lm-eval's TaskManager that found them

    def identity(self) -> dict:
        """What makes two scores of the same model comparable, task by task."""
        return {name: [t["config_sha256"], t["data_sha256"]] for name, t in sorted(self.tasks.items())}


def _include_paths(include: list[Path]) -> list[Path]:
    paths = [TASKS_DIR]
    for folder in include:
        folder = Path(folder).expanduser()
        if not folder.is_dir():
            raise EvalError(f"--include {folder}: not a folder; give a folder of lm-eval task YAML files")
        paths.append(folder.resolve())
    return paths


def task_manager(names: list[str], include: list[Path], builtin: bool | None = None):
    """lm-eval's TaskManager over lodger's tasks and ``include``, and over lm-eval's own tasks when
    ``builtin`` (None: only when a name is not among the others)."""
    from lm_eval.tasks import TaskManager

    paths = [str(p) for p in _include_paths(include)]
    if builtin is None:
        local = TaskManager(include_path=paths, include_defaults=False)
        if all(name in local.all_tasks or Path(name).is_file() for name in names):
            return local
        builtin = True
    return TaskManager(include_path=paths, include_defaults=builtin)


@contextlib.contextmanager
def quiet(log: Path | None):
    """lm-eval's and datasets' own output (progress bars, warnings) to ``log``, not the terminal."""
    from .. import durable

    out = durable.open_file(log, "a", encoding="utf-8") if log else open(os.devnull, "a", encoding="utf-8")
    with out, contextlib.redirect_stderr(out):
        yield


def load_tasks(names: list[str], include: list[Path] | None = None, *, builtin: bool | None = None,
               log: Path | None = None) -> TaskSet:
    """Load each named task, group or tag (data from the local cache only) and hash what it is.

    ``builtin``: whether lm-eval's own tasks are looked at (None: only when a name is not found
    among lodger's and ``include``'s)."""
    manager = task_manager(names, list(include or []), builtin)
    objects, tasks, groups = [], {}, []
    for name in names:
        with quiet(log):
            loaded = _load_one(manager, name)
        if name in loaded["groups"]:
            objects.append(loaded["groups"][name])
            groups.extend(loaded["groups"])
        else:
            objects.extend(loaded["tasks"].values())
        for task_name, task in loaded["tasks"].items():
            tasks[task_name] = describe_task(task)
    return TaskSet(list(names), objects, tasks, sorted(set(groups)), manager)


def _load_one(manager, name: str) -> dict:
    try:
        return manager.load([name])
    except KeyError:
        own = sorted(t for t in manager.all_tasks if t.startswith("lodger_"))
        raise EvalError(f"--tasks {name}: no lm-eval task, group or tag has that name (lodger's own: "
                        f"{', '.join(own)}; `lm-eval ls tasks` lists lm-eval's; a task of your own: "
                        "--include FOLDER with its YAML file)") from None
    except EvalError:
        raise
    except Exception as exc:  # datasets' offline and missing-file errors have no common base
        raise _not_available(manager, name, exc) from None


def _not_available(manager, name: str, exc: Exception) -> EvalError:
    """The error for a task whose data cannot be loaded here: which task, which data, what to do."""
    import datasets

    cache = datasets.config.HF_DATASETS_CACHE
    where = _dataset_of(manager, name)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, FileNotFoundError) and (where is None or where[0] in LOCAL_BUILDERS):
        return EvalError(f"task {name}: a file it reads is missing ({first}); restore the file, or fix its path "
                         "in the task's YAML (data_files) and run `lodger eval` again")
    load = (f"datasets.load_dataset({where[0]!r}" + (f", {where[1]!r}" if where[1] else "") + ")") if where else None
    how = (f"on a machine that may download, run `python -c \"import datasets; {load}\"`" if load else
           "on a machine that may download, load the task once with lm-eval")
    return EvalError(f"task {name}: its data cannot be loaded here ({type(exc).__name__}: {first}); lodger never "
                     f"downloads (HF_DATASETS_OFFLINE=1), so the data must be in the local datasets cache "
                     f"({cache}). Make it available: {how}, then copy that machine's cache folder to {cache} (or "
                     "set HF_DATASETS_CACHE to a copy), and run `lodger eval` again")


def _dataset_of(manager, name: str) -> tuple[str, str | None] | None:
    """(dataset_path, dataset_name) from a task's YAML, where the name is one task with a file."""
    entry = manager.task_index.get(name)
    if entry is None or getattr(entry, "yaml_path", None) is None:
        return None
    try:
        from lm_eval.tasks._yaml_loader import load_yaml

        config = load_yaml(entry.yaml_path, resolve_func=False)
    except Exception:  # noqa: BLE001 - only a hint for the message
        return None
    path = config.get("dataset_path")
    return (str(path), config.get("dataset_name")) if path else None


def describe_task(task) -> dict:
    """A leaf task's identity: version, sha256 of its resolved config and of its evaluation documents."""
    config = task.dump_config()
    config.get("metadata", {}).pop("config_source", None)  # where the YAML sits on this machine
    digest, count = hashlib.sha256(), 0
    for doc in task.eval_docs:
        digest.update(_canonical(doc).encode() + b"\n")
        count += 1
    meta = config.get("metadata") or {}
    return {"version": meta.get("version"), "config_sha256": sha256_json(config), "data_sha256": digest.hexdigest(),
            "docs": count, "output_type": config.get("output_type"), "num_fewshot": config.get("num_fewshot"),
            "dataset": config.get("dataset_path") or ("custom" if config.get("custom_dataset") else None)}


def score(model, tokenizer, task_set: TaskSet, *, limit: int | None, batch_size: int,
          chat_template: bool = False, log: Path | None = None) -> dict:
    """Run lm-eval's ``simple_evaluate`` on an already loaded model (lodger's), in this process.

    lm-eval's own output (progress bars, warnings) goes to ``log``, not to the terminal: lodger
    says what happens in its own lines."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    with quiet(log):
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        # The manager goes along: without one, lm-eval would index its thousands of built-in tasks again.
        return simple_evaluate(model=lm, tasks=list(task_set.objects), task_manager=task_set.manager, limit=limit,
                               log_samples=False, apply_chat_template=chat_template)


def scores_of(results: dict, task_set: TaskSet) -> dict:
    """Per task (and group): every metric with its standard error, and the samples scored."""
    out: dict[str, dict] = {"tasks": {}, "groups": {}}
    for name, row in results.get("results", {}).items():
        metrics = {}
        for key, value in row.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, filtered = key.split(",", 1)
            stderr = row.get(f"{metric}_stderr,{filtered}")
            label = metric if filtered == "none" else f"{metric},{filtered}"
            metrics[label] = {"value": _number(value), "stderr": _number(stderr)}
        if name in task_set.tasks:
            n = results.get("n-samples", {}).get(name, {})
            out["tasks"][name] = {**task_set.tasks[name], "metrics": metrics,
                                  "samples": n.get("effective"), "samples_available": n.get("original")}
        else:
            out["groups"][name] = {"metrics": metrics}
    return out


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def metric_text(metric: dict | None) -> str:
    """"0.4583 ± 0.0727" (or "-")."""
    if not metric or metric.get("value") is None:
        return "-"
    stderr = metric.get("stderr")
    return f"{metric['value']:.4f}" + (f" ± {stderr:.4f}" if stderr is not None else "")
