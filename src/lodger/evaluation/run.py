"""`lodger eval`: a run's trained weights and its base model scored by lm-eval, recorded in the ledger.

The evaluation takes the run's lock, so it is what `lodger pause`, `lodger resume` and the agent
see of the run while it lasts, and it yields as training does: yield points at every transformer
layer (``train/step.install_yield_points``), a hold sleeps in place and keeps memory, a release
(or SIGTERM, or Ctrl-C) abandons the model being scored and exits; what was scored before stays
recorded, and running the command again scores only what is missing. Requests written before the
evaluation started (a paused run's own pause) are not for it. It runs at the run's [limits]
priority and on the run's thread count.

Each model scored is one chained ``harness_eval`` event: the harness and its version, the model
(base: the source's sha256; trained weights: the file's sha256 and its step), per task the hashes
of its config and data, metrics with standard errors and samples, and the settings (limit, batch
size, chat template). No torch at import.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import durable
from ..owner.control import Control, ReleaseRequested, clear_request
from ..errors import CheckpointError, ModelSourceError, RunStateError
from .harness import HARNESS, TaskSet, harness_version, load_tasks, offline, score, scores_of, sha256_json
from ..home import run_dir
from ..ledger import Ledger
from ..owner.runlock import RunLock, holder

WEIGHT_FILES = ("adapter_model.safetensors", "model.safetensors")


@dataclass
class Subject:
    """One model to score: the run's base, or its trained weights at one step."""

    role: str                                  # "base" or "adapter"
    label: str                                 # "base", "adapter@step-24"
    sha256: str                                # base: its source files; adapter: the weights file
    step: int | None = None
    where: str | None = None                   # the weights file, relative to the run folder
    files: dict[str, bytes] = field(default_factory=dict, repr=False)  # trained weights (adapter only)

    def record(self) -> dict:
        return {"role": self.role, "label": self.label, "sha256": self.sha256, "step": self.step, "file": self.where}


@dataclass
class Outcome:
    """What one `lodger eval` did: scores per subject label, what was reused, whether it finished."""

    run_id: str
    harness: dict
    tasks: TaskSet | None = None
    scores: dict[str, dict] = field(default_factory=dict)    # label -> the event's data
    reused: list[str] = field(default_factory=list)           # labels already recorded with the same key
    stopped: dict | None = None                               # {"by", "reason", "label"} when it gave way
    scoring: Subject | None = None                            # the model being scored (or loaded) now

    @property
    def complete(self) -> bool:
        return self.stopped is None


# -- what is scored (no torch) ---------------------------------------------------------------
def base_source(ledger: Ledger, run: dict):
    """The run's base model, resolved again and checked to be the one it trained against."""
    from ..model import resolve_source

    segments = ledger.provenance(run["id"])
    if not segments:
        raise RunStateError(f"run {run['id']} has no provenance record: it never started, so it has no trained "
                            "weights to evaluate")
    record = segments[-1]["model"]
    source = resolve_source(record["source"])
    if source.sha256 != record.get("sha256"):
        raise ModelSourceError(f"run {run['id']}: its base model {record['source']!r} changed since the run trained "
                               f"on it (sha256 {record.get('sha256')}, now {source.sha256}); restore the original "
                               "model files to evaluate it")
    return source, record


def trained_weights(run: dict, checkpoint: int | None) -> Subject:
    """The run's final weights (its adapter folder), or one committed checkpoint's, verified."""
    from ..checkpoint import CheckpointStore
    from ..hashing import hash_file

    folder = run_dir(run["id"])
    if checkpoint is None:
        for name in WEIGHT_FILES:
            path = folder / "adapter" / name
            if path.is_file():
                step = run["step"] if run["status"] == "finished" else None
                config = folder / "adapter" / "adapter_config.json"
                files = {name: path.read_bytes(), **({config.name: config.read_bytes()} if config.is_file() else {})}
                return Subject("adapter", "adapter" + (f"@step-{step}" if step is not None else ""),
                               hash_file(path), step, f"adapter/{name}", files)
    store_root = folder / "checkpoints"
    found = dict(CheckpointStore(store_root, keep_last=2).committed()) if store_root.is_dir() else {}
    steps = [checkpoint] if checkpoint is not None else sorted(found, reverse=True)
    if checkpoint is not None and checkpoint not in found:
        have = ", ".join(str(s) for s in sorted(found)) or "none"
        raise RunStateError(f"--checkpoint {checkpoint}: run {run['id']} has no committed checkpoint at that step "
                            f"(committed: {have})")
    problems = []
    for step in steps:
        try:
            ckpt = CheckpointStore(store_root, keep_last=2).load(found[step])
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        weights = next((n for n in WEIGHT_FILES if n in ckpt.files), None)
        if weights is None:
            problems.append(f"{found[step].name}: no trained weights in it")
            continue
        files = {n: ckpt.files[n] for n in (weights, "adapter_config.json") if n in ckpt.files}
        return Subject("adapter", f"adapter@step-{step}", ckpt.manifest["files"][weights]["sha256"], step,
                       f"checkpoints/{found[step].name}/{weights}", files)
    raise RunStateError(f"run {run['id']} has no trained weights to evaluate yet (no adapter folder and no good "
                        "committed checkpoint" + (f": {'; '.join(problems)}" if problems else "") + ")")


def eval_key(harness: dict, subject: Subject, base_sha256: str, tasks: TaskSet, settings: dict) -> str:
    """Two evaluations with the same key scored the same model on the same tasks the same way."""
    return sha256_json([harness, subject.role, subject.sha256, base_sha256, tasks.identity(), settings])


def recorded(ledger: Ledger, run_id: str, key: str) -> dict | None:
    """The newest `harness_eval` event of ``run_id`` with this key, or None."""
    found = [e for e in ledger.harness_evals(run_id) if e["data"].get("key") == key]
    return found[-1] if found else None


# -- the evaluation --------------------------------------------------------------------------
def evaluate_run(run_id: str, *, tasks: list[str], include: list[Path] | None = None, limit: int | None = None,
                 checkpoint: int | None = None, with_base: bool = True, again: bool = False,
                 threads: int | None = None, batch_size: int = 8, chat_template: bool = False,
                 say: Callable[[str], None] = lambda line: None) -> Outcome:
    """Score RUN's trained weights (and its base) on ``tasks``; record each model's scores."""
    offline()  # before anything imports datasets, the hub or tqdm
    with Ledger() as ledger:
        run = ledger.find_run(run_id)
        if run.get("target"):
            raise RunStateError(f"run {run['id']} ran on remote target {run['target']}; `lodger sync {run['id']}` "
                                "brings its checkpoints home, evaluate a local run")
        source, model_record = base_source(ledger, run)
        subjects = ([Subject("base", "base", source.sha256)] if with_base else []) + [trained_weights(run, checkpoint)]
        outcome = Outcome(run["id"], {"name": HARNESS, "version": harness_version()})
        folder = run_dir(run["id"])
        pid = holder(folder)
        if pid is not None:
            raise RunStateError(f"run {run['id']} is in use by process {pid} (training, or another `lodger eval`); "
                                f"evaluate it once that has stopped (`lodger pause {run['id']}` releases it)")
        control = Control(folder, since=time.time()).install_signal_handlers()
        control.on_hold = lambda request: _held(ledger, run["id"], control, request, say)
        control.on_continue = lambda request, seconds: _continued(ledger, run["id"], request, seconds, say)
        lock = RunLock(folder)
        try:
            clear_request(folder, "agent")  # judged afresh for this process by the agent's next look
            job = _job_of(run)
            _apply_limits(job, say)
            say(f"{HARNESS} {outcome.harness['version']}: loading tasks {', '.join(tasks)} (local data only)")
            task_set = outcome.tasks = load_tasks(tasks, include, log=_harness_dir(run["id"]) / "lm-eval.log")
            settings = {"limit": limit, "batch_size": batch_size, "chat_template": chat_template}
            base_sha = source.sha256
            todo = []
            for subject in subjects:
                key = eval_key(outcome.harness, subject, base_sha, task_set, settings)
                earlier = None if again else recorded(ledger, run["id"], key)
                if earlier is not None:
                    outcome.reused.append(subject.label)
                    outcome.scores[subject.label] = earlier["data"]
                    say(f"{subject.label}: already scored this way (ledger row {earlier['seq']}); --again scores it anew")
                else:
                    todo.append((subject, key))
            if todo:
                outcome.scoring = todo[0][0]
                try:
                    yield_now(control)  # loading tasks can take a while: answer what came meanwhile
                    _score_all(ledger, run, job, source, model_record, todo, outcome, task_set, settings, control,
                               threads, say)
                except ReleaseRequested:
                    _gave_way(ledger, run["id"], outcome, control.release or {}, say)
                except _Stopped as stop:
                    _gave_way(ledger, run["id"], outcome, {"by": "signal", "reason": str(stop)}, say)
        finally:
            lock.release()
    return outcome


def _job_of(run: dict):
    import tomllib

    from ..config import JobConfig

    return JobConfig.model_validate(tomllib.loads(run["job_toml"]))


def _apply_limits(job, say) -> None:
    from ..train.limits import apply_limits

    applied = apply_limits(job.limits)
    if "nice" in applied:
        say(f"priority: nice {applied['nice']} (the run's [limits])")


def _score_all(ledger, run, job, source, model_record, todo, outcome: Outcome, tasks: TaskSet, settings: dict,
               control: Control, threads: int | None, say) -> None:
    """Load the base once, score each subject on it (the adapter on top, after the base), record each."""
    import torch

    from ..model import load_base_model, load_tokenizer, model_folder, preparation_notice, quiet_transformers
    from ..train.step import install_yield_points

    quiet_transformers()
    torch.set_num_threads(threads or job.training.threads or torch.get_num_threads())
    device = "cuda" if job.training.device != "cpu" and torch.cuda.is_available() else "cpu"
    notice = preparation_notice(source)
    if notice:
        say(notice)
    folder = model_folder(source)
    tokenizer, model = load_tokenizer(folder), load_base_model(folder)
    model.config.use_cache = True  # no training here: generation tasks reuse their keys and values
    model.to(device).eval()
    install_yield_points(model, control)
    model.register_forward_pre_hook(lambda module, args: _check_stop(control))
    control.in_step = True  # a release anywhere in here drops the model being scored (nothing to undo)
    yield_now(control)
    extra = {"device": device, "threads": torch.get_num_threads(), "dtype": "float32",
             "tokenizer_sha256": model_record.get("tokenizer_sha256"), "base_source": model_record.get("source")}
    for subject, key in todo:
        outcome.scoring = subject
        if subject.role == "adapter":
            model = _with_weights(model, subject, job.method)
        control.step = subject.step or 0
        say(f"{subject.label}: scoring {len(tasks.tasks)} task(s) on {extra['threads']} thread(s), "
            f"batch {settings['batch_size']}" + (f", {settings['limit']} examples per task" if settings["limit"] else ""))
        started, held_before = time.perf_counter(), control.held_seconds
        with torch.no_grad():
            results = score(model, tokenizer, tasks, limit=settings["limit"],
                            batch_size=settings["batch_size"], chat_template=settings["chat_template"],
                            log=_harness_dir(run["id"]) / "lm-eval.log")
        held = control.held_seconds - held_before
        data = {"subject": subject.record(), "harness": outcome.harness, "settings": settings, "key": key,
                **scores_of(results, tasks), "environment": extra,
                "seconds": round(time.perf_counter() - started - held, 3), "held_seconds": round(held, 3)}
        data["seq"] = ledger.event(run["id"], "harness_eval", **data)
        _keep_results(run["id"], subject, key, results)
        outcome.scores[subject.label] = data
        say(f"{subject.label}: scored in {data['seconds']:.1f} s, recorded (ledger row {data['seq']})")


class _Stopped(Exception):
    """SIGTERM or Ctrl-C arrived: stop scoring at the next forward."""


def _check_stop(control: Control) -> None:
    if control.stop:
        raise _Stopped(control.stop)


def yield_now(control: Control) -> None:
    """Between two phases (tasks loaded, model loaded): answer a hold, a release or a stop now."""
    control.checkpoint_boundary(release_ok=True)
    _check_stop(control)


def _with_weights(model, subject: Subject, method):
    """The base with the run's trained weights: a peft adapter on top, or full weights copied in."""
    if "adapter_model.safetensors" in subject.files:
        from peft import PeftModel

        with tempfile.TemporaryDirectory(prefix="lodger-eval-adapter-") as tmp:
            for name, data in subject.files.items():
                (Path(tmp) / name).write_bytes(data)
            wrapped = PeftModel.from_pretrained(model, tmp)
        return wrapped.eval()
    from safetensors.torch import load as load_tensors

    from ..model import load_trainable_state

    load_trainable_state(model, method, load_tensors(subject.files["model.safetensors"]))
    return model


def _held(ledger, run_id: str, control: Control, request: dict, say) -> None:
    ledger.event(run_id, "eval_held", by=request.get("by"), reason=request.get("reason"), step=control.step)
    say(f"held by {request.get('by')} ({request.get('reason')}): memory kept, no CPU used; "
        f"`lodger resume {run_id}` continues")


def _continued(ledger, run_id: str, request: dict, seconds: float, say) -> None:
    ledger.event(run_id, "eval_continued", by=request.get("by"), held_seconds=round(seconds, 3))
    say(f"continuing after {seconds:.1f} s held")


def _gave_way(ledger, run_id: str, outcome: Outcome, request: dict, say) -> None:
    subject = outcome.scoring
    assert subject is not None  # set before anything that can give way starts
    outcome.stopped = {"by": request.get("by"), "reason": request.get("reason"), "label": subject.label}
    ledger.event(run_id, "eval_abandoned", by=request.get("by"), reason=request.get("reason"),
                 subject=subject.record(), scored=sorted(outcome.scores))
    say(f"{subject.label}: abandoned, the machine given back ({request.get('by')}: {request.get('reason')})")


def _keep_results(run_id: str, subject: Subject, key: str, results: dict) -> None:
    """lm-eval's own results file beside the run, for tools that read it (the ledger is the record)."""
    import json

    name = f"{subject.label.replace('@', '-')}-{key[:12]}.json"
    durable.atomic_write(_harness_dir(run_id) / name, json.dumps(results, indent=1, sort_keys=True, default=str).encode())


def _harness_dir(run_id: str) -> Path:
    return durable.make_dirs(run_dir(run_id) / "harness")
