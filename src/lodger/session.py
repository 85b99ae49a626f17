"""A run from start to end: validate everything, create the run folder, build the model, restore
the newest good checkpoint when resuming, run the loop, and record what happened.

Nothing is written for a new run until the job, the data and the model have all been checked.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import durable
from .checkpoint import Checkpoint, CheckpointStore
from .config import JobConfig, load_job, to_toml, total_steps
from .control import Control, ReleaseRequested, clear_request, write_request
from .distributed import Ranks
from .data import DataFile, Sampler, TokenizedSet, read_jsonl, split_indices, tokenize
from .errors import CheckpointError, JobFileError, LimitReached, PreflightError, RunStateError
from .home import run_dir
from .report import plural
from .train.guard import GuardState
from .runlock import RunLock, is_locked  # noqa: F401 (is_locked is part of this module's API)
from .ledger import Ledger
from .ledger import provenance as prov
from .recovery import complete_ledger, sync_metrics
from .restarts import mark_starting
from .compare import segment_compute
from .model import ModelSource, check_target_modules, model_folder, resolve_source, tokenizer_hash

JOB_FILE = "job.toml"


@dataclass
class Progress:
    """Counters saved in every checkpoint."""

    step: int = 0        # optimizer steps taken
    position: int = 0    # examples drawn from the sampler (global position across epochs)
    tokens: int = 0      # target tokens trained on
    segment: int = 0     # 0 for the first start, +1 at every resume


@dataclass
class Prepared:
    """Everything validated before a run folder exists."""

    job: JobConfig
    source: ModelSource
    folder: Path
    tokenizer: Any
    tokenizer_sha: str
    train_file: DataFile
    eval_file: DataFile | None
    train_set: TokenizedSet
    eval_set: TokenizedSet | None
    train_indices: list[int]
    eval_indices: list[int]
    total_steps: int
    device: str = "cpu"


def prepare(job: JobConfig, device: str | None = None) -> Prepared:
    """Validate data (every line), resolve and cache the model, tokenise. Writes only caches.

    ``device`` skips choosing one here: the gate prepares a job for another machine's device."""
    from .model import load_tokenizer

    train_file = read_jsonl(job.data.train)
    eval_file = read_jsonl(job.data.eval) if job.data.eval is not None else None
    source = resolve_source(job.model.source)
    folder = model_folder(source)
    tokenizer = load_tokenizer(folder)
    tok_sha = tokenizer_hash(folder)
    check_target_modules(folder, job.method)
    train_set = tokenize(train_file, tokenizer, tok_sha, job.data.max_length)
    if eval_file is not None:
        eval_set = tokenize(eval_file, tokenizer, tok_sha, job.data.max_length)
        train_indices, eval_indices = list(range(len(train_set))), list(range(len(eval_set)))
    else:
        train_indices, eval_indices = split_indices(len(train_set), job.data.eval_fraction, job.training.seed)
        eval_set = train_set if eval_indices else None
    return Prepared(job, source, folder, tokenizer, tok_sha, train_file, eval_file, train_set, eval_set,
                    train_indices, eval_indices, total_steps(job, len(train_indices)), device or pick_device(job))


def pick_device(job: JobConfig) -> str:
    """`auto` takes the GPU when there is one; asking for one that is not there is an error."""
    import torch

    wanted = job.training.device
    if wanted == "cuda" and not torch.cuda.is_available():
        raise JobFileError("[training] device = \"cuda\": no CUDA device here; use \"auto\" or \"cpu\"")
    device = "cuda" if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()) else "cpu"
    world = job.training.world_size
    if device == "cuda" and world > torch.cuda.device_count():
        raise JobFileError(f"[training] world_size = {world}: data-parallel training takes one GPU per process and "
                           f"this machine has {torch.cuda.device_count()}; lower world_size, or use "
                           "device = \"cpu\"")
    if job.training.precision == "fp16" and device != "cuda":
        raise JobFileError("[training] precision = \"fp16\" needs a GPU (loss scaling is a GPU feature); "
                           "use \"bf16\" on the CPU")
    return device


def configure_determinism(device: str) -> None:
    """Same inputs, same bits: deterministic kernels everywhere, and the cuBLAS setting that allows it."""
    import torch

    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # must be set before cuBLAS starts
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    # On CUDA warn_only=True let attention's backward pick non-deterministic kernels: two bf16 runs
    # differed from step 3 on an H200 (docs/gpu.md). Strict there; on the CPU every kernel we use
    # is deterministic and warn_only keeps an unusual op from stopping a run.
    torch.use_deterministic_algorithms(True, warn_only=device != "cuda")


def _job_hash(job: JobConfig) -> str:
    return hashlib.sha256(json.dumps(job.resolved_dict(), sort_keys=True).encode()).hexdigest()


def preflight(prepared: Prepared, force: bool = False) -> dict:
    """Estimate peak memory; refuse (before anything is written) a job that will not fit."""
    from .memory import estimate, memory_available, runtime_bytes, suggestions

    job = prepared.job
    config = json.loads((prepared.folder / "config.json").read_text())
    longest = int((prepared.train_set.offsets[1:] - prepared.train_set.offsets[:-1]).max())
    runtime = None if prepared.device == "cuda" else runtime_bytes(threads=job.training.threads, use_current=False)
    est = estimate(job, config, seq_len=min(longest, job.data.max_length), device=prepared.device,
                   runtime_bytes=runtime)
    # Data-parallel ranks on the CPU share this machine's memory; on GPUs each has its own device.
    ranks = 1 if prepared.device == "cuda" else job.training.world_size
    if prepared.device == "cuda":
        import torch

        available, what = torch.cuda.mem_get_info()[0], "free GPU memory"
    else:
        available, what = memory_available(), "available memory"
    needed = est.total_bytes * ranks
    if job.limits.memory_gb and job.limits.memory_gb * 2**30 * ranks < available:  # the ceiling is per process
        available, what = int(job.limits.memory_gb * 2**30) * ranks, "[limits] memory_gb"
    summary = {"total_bytes": est.total_bytes, "largest": est.largest, "items": est.items,
               "available_bytes": available, "device": prepared.device, "forced": False, "processes": ranks}
    if needed > available:
        if not force:
            gib = 2**30
            fixes = "\n".join(f"  - {fix}" for fix in suggestions(est, job, available // ranks))
            each = f" ({ranks} processes of {est.total_bytes / gib:.2f} GiB)" if ranks > 1 else ""
            raise PreflightError(
                f"this job needs an estimated {needed / gib:.2f} GiB at its peak{each}, more than the "
                f"{available / gib:.2f} GiB of {what}; the largest item is {est.largest} "
                f"({est.items[est.largest] / gib:.2f} GiB). What would make it fit:\n{fixes}\n"
                "(`lodger estimate JOB` shows the breakdown; `--force` runs it anyway and records that)")
        summary["forced"] = True
    return summary


def create_run(job_path: Path, threads: int | None = None, *, name: str | None = None,
               reproduces: str | None = None, managed: bool = False, force: bool = False,
               run_id: str | None = None) -> tuple[str, Prepared]:
    """Validate a job file and create its run (folder and ledger row) atomically.

    ``run_id`` is given only by a remote worker: its run keeps the id of the local run it serves."""
    job = load_job(job_path)
    if threads is not None:
        job.training.threads = threads
    if job.training.threads is None:
        job.training.threads = len(os.sched_getaffinity(0))
    prepared = prepare(job)
    memory = preflight(prepared, force)
    name = name or job.name or Path(job_path).stem
    run_id = run_id or new_run_id(name)
    durable.write_folder(run_dir(run_id), {JOB_FILE: to_toml(job.resolved_dict()).encode()})
    mark_starting(run_dir(run_id))  # the agent leaves a "created" run alone while its creator lives
    with Ledger() as ledger:
        ledger.create_run(run_id, name=name, model=job.model.source, method=job.method.kind,
                          job_hash=_job_hash(job), job_toml=to_toml(job.resolved_dict()),
                          total_steps=prepared.total_steps, pid=None, reproduces=reproduces, managed=managed,
                          estimate=memory)
    durable.fault_point("after_create_run")
    return run_id, prepared


def new_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


class Session:
    """The live state of one process training one run, and how it records itself."""

    def __init__(self, run_id: str, prepared: Prepared, ledger: Ledger | None, quiet: bool = False,
                 control: Control | None = None, ranks: Ranks = Ranks()):
        import torch

        from .model import attach_method, load_base_model
        from .rng import seed_everything
        from .train.optim import build_optimizer

        self.run_id, self.p, self.ledger = run_id, prepared, ledger
        self.job = prepared.job
        self.dir = run_dir(run_id)
        self.quiet = quiet
        # Rank 0 is the run (ledger, metrics, log, checkpoints); other ranks have no ledger and write nothing.
        self.rank, self.world_size = ranks.rank, ranks.world_size
        from .train.guard import Guard
        from .train.precision import Precision

        self.control = control or Control(self.dir)
        self.device = prepared.device
        self.applied_limits = apply_limits(self.job.limits)
        torch.set_num_threads(self.job.training.threads)
        configure_determinism(self.device)
        seed_everything(self.job.training.seed)
        base = load_base_model(prepared.folder)
        if self.job.training.gradient_checkpointing:
            # non-reentrant checkpointing restores the RNG for the recomputation, so dropout stays exact
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            base.enable_input_require_grads()
        self.model = attach_method(base, self.job.method, self.job.training.seed).to(self.device)
        if self.rank > 0:  # same weights on every rank (seeded above); then its own dropout stream
            from .distributed import rank_seed

            seed_everything(rank_seed(self.job.training.seed, self.rank))
        self.precision = Precision(self.job.training.precision, self.device)
        self.guard = Guard(self.job.guard)
        poison = os.environ.get("LODGER_TEST_POISON_LINES", "")
        self.poison_lines = {int(x) for x in poison.split(",") if x.strip()}
        self.optimizer = build_optimizer([q for q in self.model.parameters() if q.requires_grad], self.job.training)
        checkpoints, keep = self.dir / "checkpoints", self.job.checkpoints.keep_last
        self.store = CheckpointStore(checkpoints, keep, self.world_size) if self.rank == 0 else None
        if self.world_size > 1:
            from .distributed import barrier

            barrier()  # rank 0 has created the checkpoints folder; the others may not race it
            if self.rank > 0:
                self.store = CheckpointStore(checkpoints, keep, self.world_size)
        self.train_set, self.eval_set = prepared.train_set, prepared.eval_set
        self.eval_indices = prepared.eval_indices
        self.sampler = Sampler(prepared.train_indices, self.job.training.seed)
        self.total_steps = prepared.total_steps
        self.pad_id = prepared.tokenizer.pad_token_id
        self.progress = Progress()
        self.pending: list[dict] = []   # metric records not yet in the ledger (they go with checkpoints)
        self.evals: dict[int, float] = {}
        self.eval_seconds = 0.0  # of the latest eval, held time left out
        self.meter = prov.ComputeMeter()
        self.fingerprint = prov.numerics_fingerprint(self.device)
        self.reporter = None
        limits = self.job.limits
        self.memory_ceiling = int(limits.memory_gb * 2**30) if limits.memory_gb else None
        self.compute_limit = limits.max_compute_hours * 3600 if limits.max_compute_hours else None
        self.prior_cpu_seconds = 0.0  # CPU seconds of earlier segments, for the compute limit
        from .remote.limits import RemoteLimits

        self.remote_limits = RemoteLimits.for_this_process(self.job.remote, self.device,
                                                           self.job.training.world_size)
        self.prior_wall_seconds = 0.0  # wall seconds of earlier segments, for the remote limits

    def check_limits(self) -> None:
        """Turn a reached memory ceiling or compute limit into a release request (checked per micro-step)."""
        if self.memory_ceiling:
            import resource

            from .report import rss_bytes

            peak = max(rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
            if peak > self.memory_ceiling:
                self._limit_reached(f"memory ceiling {self.memory_ceiling / 2**30:.2f} GiB reached (peak resident "
                                    f"{peak / 2**30:.2f} GiB); raise [limits] memory_gb, or lower batch_size / "
                                    f"max_length", rss_bytes=peak)
        if self.compute_limit and self.prior_cpu_seconds + time.process_time() - self.meter.cpu0 > self.compute_limit:
            self._limit_reached(f"compute limit of {self.compute_limit / 3600:g} CPU hours reached; raise "
                                "[limits] max_compute_hours to continue")
        if self.remote_limits:
            wall = self.prior_wall_seconds + time.time() - self.meter.wall0
            reason = self.remote_limits.reached(wall)
            if reason:
                self._limit_reached(reason, **self.remote_limits.measure(wall))

    def _limit_reached(self, reason: str, **measured) -> None:
        if self.control.release is None:
            write_request(self.dir, "limit", "release", reason, **measured)
            self.control.wake()

    def poison_factor(self, ids: list[int]) -> float:
        """Inf when a micro-batch holds a poisoned line (test-only fault injection), else 1."""
        return math.inf if any(int(self.train_set.lines[i]) in self.poison_lines for i in ids) else 1.0

    def rollback(self) -> None:
        """Too many bad steps in a row: back to the last good checkpoint, lower lr, skip the bad batches."""
        carried = self.guard.start_rollback()  # raises TrainingDiverged after too many rollbacks
        bad_from = self.progress.step
        ckpt = self.agreed_checkpoint()
        if ckpt is None:
            from .train.guard import TrainingDiverged

            raise TrainingDiverged(f"non-finite loss or gradient norm at steps {carried['bad_steps']} and no "
                                   "checkpoint to roll back to; lower [training] learning_rate or check the data")
        self.restore(ckpt)
        self.guard.state = GuardState(**carried)
        if self.rank > 0:
            return
        self.truncate_metrics(ckpt.step)
        self.ledger.event(self.run_id, "rollback", from_step=bad_from, to_step=ckpt.step,
                          rollbacks=carried["rollbacks"], lr_scale=carried["lr_scale"],
                          skipped_batches=carried["skip_positions"], bad_steps=carried["bad_steps"])
        self.reporter.message(f"rollback {carried['rollbacks']}: steps {carried['bad_steps']} were non-finite; back "
                              f"to step {ckpt.step}, learning rate x{carried['lr_scale']:g}, bad batches skipped")

    # -- several ranks ------------------------------------------------------------------------
    def sync_step(self, params, loss_sum, last_save: float):
        """The step's one collective: sum gradients and loss over ranks, with rank 0's answer to its
        control requests (release, stop, time-based checkpoint) riding along. A hold on rank 0 holds
        every rank here, at the same place. Returns (global loss, (release, stop, save_due))."""
        from .distributed import N_FLAGS, RELEASE, SAVE_DUE, STOP, reduce_step

        flags = [0.0] * N_FLAGS
        if self.rank == 0:
            self.check_limits()
            try:
                self.control.checkpoint_boundary()
            except ReleaseRequested:  # with several ranks a release finishes the step first
                flags[RELEASE] = 1.0
            flags[STOP] = float(self.control.stop is not None)
            every = self.job.checkpoints.every_seconds
            flags[SAVE_DUE] = float(every is not None and time.monotonic() - last_save >= every)
        loss_sum, summed = reduce_step(params, loss_sum, flags)
        return loss_sum, tuple(value > 0 for value in summed)

    def agreed_checkpoint(self, on_damaged=None) -> Checkpoint | None:
        """The newest good checkpoint, as rank 0 finds it (only rank 0 moves damaged ones aside)."""
        if self.world_size == 1:
            return self.store.latest_good(on_damaged=on_damaged, check=self.check_contents)
        from .distributed import broadcast_int

        if self.rank == 0:
            ckpt = self.store.latest_good(on_damaged=on_damaged, check=self.check_contents)
            broadcast_int(-1 if ckpt is None else ckpt.step)
            return ckpt
        step = broadcast_int(-1)
        return None if step < 0 else self.store.load(self.store.root / f"step-{step:08d}")

    # -- restoring ---------------------------------------------------------------------------
    def check_contents(self, ckpt: Checkpoint) -> None:
        """Raise CheckpointError unless ``restore`` finds everything it reads: a checkpoint whose
        hashes verify can still lack a key (written by another version, or by hand), and is then
        damaged like any other, so resume falls back to the previous one."""
        from .checkpoint import safetensors_problem

        weights = "adapter_model.safetensors" if self.job.method.kind == "lora" else "model.safetensors"
        ranks = [f"rng-rank-{r}.json" for r in range(1, int(ckpt.manifest.get("world_size") or 1))]
        needed = ["state.json", weights, "optimizer.json", "optimizer.safetensors", "rng.safetensors", *ranks]
        problems = [f"no {name}" for name in needed if name not in ckpt.files]
        for name in needed:
            if name in ckpt.files and name.endswith(".safetensors"):
                why = safetensors_problem(ckpt.files[name])
                problems += [f"{name}: {why}"] if why else []
            elif name in ckpt.files:
                try:
                    parsed = json.loads(ckpt.files[name])
                except ValueError as exc:
                    parsed, problems = None, problems + [f"{name} is not valid JSON ({exc})"]
                if name == "state.json" and isinstance(parsed, dict):
                    problems += _state_problems(parsed, ckpt.step)
                elif name == "optimizer.json" and isinstance(parsed, dict):
                    problems += [f"optimizer.json lacks `{k}`" for k in ("param_groups", "plain") if k not in parsed]
                elif parsed is not None and not isinstance(parsed, dict):
                    problems.append(f"{name} is not a JSON object")
        if problems:
            raise CheckpointError(f"{ckpt.path.name}: its files verify but cannot be restored: {'; '.join(problems)}")

    def restore(self, ckpt: Checkpoint) -> list[str]:
        """Load every piece of state from a verified checkpoint; return the drift found (if any)."""
        from safetensors.torch import load as load_tensors

        from .distributed import refuse_other_world_size
        from .model import load_trainable_state
        from .rng import from_json as rng_from_json
        from .rng import restore as restore_rng
        from .train.optim import load_optimizer

        refuse_other_world_size(self.run_id, ckpt.manifest.get("world_size", 1), self.world_size)
        state = json.loads(ckpt.files["state.json"])
        weights = "adapter_model.safetensors" if self.job.method.kind == "lora" else "model.safetensors"
        load_trainable_state(self.model, self.job.method, load_tensors(ckpt.files[weights]))
        load_optimizer(self.optimizer, ckpt.files)
        if self.rank == 0:
            restore_rng(load_tensors(ckpt.files["rng.safetensors"]), state["rng"])
        else:
            restore_rng(*rng_from_json(json.loads(ckpt.files[f"rng-rank-{self.rank}.json"])))
        # In place: the loop holds references to these objects across a rollback.
        for key, value in state["progress"].items():
            setattr(self.progress, key, value)
        self.evals = {int(k): v for k, v in state.get("evals", {}).items()}
        self.guard.state = GuardState(**state.get("guard", {}))
        self.precision.load(state.get("scaler", {}))
        return prov.drift(state["numerics"], self.fingerprint)

    # -- recording ---------------------------------------------------------------------------
    def _metrics_append(self, record: dict) -> None:
        if self.rank > 0:
            return
        with open(self.dir / "metrics.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        self.pending.append(record)

    def truncate_metrics(self, step: int) -> int:
        """Drop metric lines after ``step``: that work was lost with the process and is done again.

        Returns the last step the previous process had reached (where it was interrupted)."""
        path = self.dir / "metrics.jsonl"
        reached = step
        if path.exists():
            records = []
            for line in path.read_text(errors="replace").splitlines():
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue  # a line torn by the crash (metrics are not fsynced); its step is redone
            reached = max([step] + [r["step"] for r in records])
            kept = [json.dumps(r) + "\n" for r in records if r["step"] <= step]
            durable.atomic_write(path, "".join(kept).encode())
        self.ledger.truncate_metrics(self.run_id, step)  # a `metrics_truncated` event says so
        durable.fault_point("after_metrics_truncate")
        return reached

    def record_step(self, *, loss: float, grad_norm: float, lr: float, tokens: int, seconds: float,
                    skipped: bool, samples: list[int] | None, held: float = 0.0) -> None:
        """``seconds`` is the step's own time; ``held`` the time the owner held it (kept apart)."""
        step = self.progress.step
        self.control.step = step
        if self.rank > 0:
            return
        record = {"kind": "train", "step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
                  "tokens": tokens, "seconds": seconds, "time": time.time(), "segment": self.progress.segment}
        if held:
            record["held_seconds"] = held
        if skipped:
            record["skipped"] = True
            self.ledger.event(self.run_id, "warning", step=step, reason="non-finite loss or gradient norm; "
                              "optimizer step skipped", sample_lines=samples)
        self._metrics_append(record)
        self.control.step = step
        every = self.job.training.log_every
        self.reporter.step(step, self.total_steps, loss, grad_norm, lr, tokens, seconds, held=held,
                           show=step % every == 0 or step == self.total_steps or step == 1)

    def has_eval_at(self, step: int) -> bool:
        return step in self.evals

    def record_eval(self, step: int, loss: float | None) -> None:
        if loss is None:
            return
        self.evals[step] = loss
        self._metrics_append({"kind": "eval", "step": step, "eval_loss": loss, "time": time.time(),
                              "segment": self.progress.segment})
        self.reporter.eval_finished(step, loss, self.eval_seconds)

    def save_checkpoint(self, skip_if_exists: bool = False) -> Path:
        existing = self.store.root / f"step-{self.progress.step:08d}"
        if skip_if_exists and existing.is_dir():  # single-process release only: ranks never skip alone
            return existing
        from safetensors.torch import save as save_tensors

        from .model import adapter_files
        from .rng import capture
        from .rng import to_json as rng_to_json
        from .train.optim import optimizer_files

        started = time.perf_counter()
        rng_tensors, rng_state = capture()
        rank_files: dict[str, bytes] = {}
        if self.world_size > 1:
            # Every rank's RNG to rank 0 as JSON; weights and optimizer state are identical on all
            # ranks (identical summed gradients), so rank 0's are saved once.
            from .distributed import barrier, gather_rng

            gathered = gather_rng(rng_to_json(rng_tensors, rng_state))
            if self.rank > 0:
                barrier()  # wait for rank 0's commit: no rank runs ahead of a checkpoint
                return existing
            rank_files = {f"rng-rank-{r}.json": json.dumps(gathered[r], sort_keys=True).encode()
                          for r in range(1, self.world_size)}
        state = {
            "progress": asdict(self.progress),
            "rng": rng_state,
            "evals": self.evals,
            "guard": self.guard.as_dict(),
            "scaler": self.precision.state(),
            "numerics": self.fingerprint,
            "total_steps": self.total_steps,
            "data": {"train_sha256": self.p.train_file.sha256,
                     "eval_sha256": self.p.eval_file.sha256 if self.p.eval_file else None},
            "model_sha256": self.p.source.sha256,
        }
        files = {**adapter_files(self.model, self.job.method), **optimizer_files(self.optimizer),
                 "rng.safetensors": save_tensors(rng_tensors),
                 "state.json": json.dumps(state, sort_keys=True).encode(), **rank_files}
        sync_metrics(self.dir)  # the lines this checkpoint covers outlive it: resume re-ingests them
        path = self.store.save(self.progress.step, files)
        seconds = time.perf_counter() - started
        size = sum(f.stat().st_size for f in path.iterdir())
        durable.fault_point("checkpoint_before_ledger")
        with self.ledger.transaction():
            self.ledger.add_metrics(self.run_id, self.progress.segment, self.pending)  # rows + their hashes
            # the event sets the run's step and loss columns (ledger/records.py): one record, chained
            self.ledger.event(self.run_id, "checkpoint", step=self.progress.step, path=path.name, bytes=size,
                              loss=next((r["loss"] for r in reversed(self.pending) if "loss" in r), None),
                              seconds=round(seconds, 4), compute=self.meter.read())
        durable.fault_point("checkpoint_after_ledger")
        self.pending = []
        self.reporter.message(f"checkpoint step {self.progress.step} committed in {seconds:.2f} s "
                              f"({size / 2**20:.1f} MiB)")
        if self.world_size > 1:
            from .distributed import barrier

            barrier()
        return path

    def write_adapter(self) -> Path:
        """The final trainable weights in their own folder (peft layout for LoRA), atomically."""
        from .model import adapter_files

        final = self.dir / "adapter"
        durable.write_folder(final, adapter_files(self.model, self.job.method), tmp_prefix=".adapter-tmp-", replace=True)
        return final

    def provenance(self) -> dict:
        p = self.p
        data = {"train": {"path": str(p.train_file.path), "sha256": p.train_file.sha256, "bytes": p.train_file.size,
                          "lines": len(p.train_file.rows)}}
        if p.eval_file is not None:
            data["eval"] = {"path": str(p.eval_file.path), "sha256": p.eval_file.sha256,
                            "bytes": p.eval_file.size, "lines": len(p.eval_file.rows)}
        eval_id = hashlib.sha256(json.dumps([p.eval_file.sha256 if p.eval_file else p.train_file.sha256,
                                             p.eval_indices]).encode()).hexdigest()
        data["eval_set_sha256"] = eval_id
        data["train_examples"], data["eval_examples"] = len(p.train_indices), len(p.eval_indices)
        for use in self.job.data_uses():  # registered dataset (name, license, owner) or not
            if use.role in data:
                data[use.role].update(use.provenance())
        model = {"source": p.source.spec, "kind": p.source.kind, "path": str(p.source.path),
                 "sha256": p.source.sha256, "tokenizer_sha256": p.tokenizer_sha, **p.source.provenance()}
        if getattr(self.job.method, "init_adapter", None) is not None:
            from .model import adapter_hash

            model["init_adapter"] = {"path": str(self.job.method.init_adapter),
                                     "sha256": adapter_hash(self.job.method.init_adapter)}
        return prov.capture(job=self.job.resolved_dict(), job_hash=_job_hash(self.job),
                            job_dir=Path(os.getcwd()), model=model, data=data,
                            seeds={"seed": self.job.training.seed}, device=self.device,
                            segment=self.progress.segment)


def take_run(run_id: str) -> tuple[Control, RunLock]:
    """Make this process the one training ``run_id``: handlers first, then the lock (from the moment
    the lock names our pid, a pause request is caught, not fatal). A detached worker does this
    before validating and tokenising, so a pause sent while it starts is answered, not refused."""
    folder = run_dir(run_id)
    # A limit is judged afresh by every process (`lodger resume` clears the user's and the agent's
    # requests itself; a user's hold survives a reboot).
    clear_request(folder, "limit")
    control = Control(folder).install_signal_handlers()
    return control, RunLock(folder)


def execute(run_id: str, prepared: Prepared, *, resuming: bool, quiet: bool = False,
            taken: tuple[Control, RunLock] | None = None) -> str:
    """Train a run in this process until it finishes or is interrupted; return the final status.

    ``taken``: what ``take_run`` returned, when this process took the run early (one process only)."""
    from . import distributed as dist

    folder = run_dir(run_id)
    world = prepared.job.training.world_size
    if resuming:  # refused before anything starts, not after N processes loaded the model
        dist.refuse_other_world_size(run_id, dist.checkpoint_world_size(folder), world)
    ranks = Ranks()
    if world > 1:
        if not dist.inside_launch():
            dist.launch(run_id, world, prepared.job.training.threads, fresh=not resuming, quiet=quiet)
        ranks = dist.init(world, prepared.device)
        if ranks.rank > 0:
            return _execute_quiet_rank(run_id, prepared, resuming=resuming, ranks=ranks)
    return _execute(run_id, prepared, resuming=resuming, quiet=quiet, ranks=ranks, taken=taken)


def _execute_quiet_rank(run_id: str, prepared: Prepared, *, resuming: bool, ranks: Ranks) -> str:
    """A rank other than 0: the same training, no lock, no ledger, no files; rank 0 speaks for the run."""
    from .report import Reporter
    from .train.loop import train

    control = Control(None).install_signal_handlers()  # SIGTERM/Ctrl-C only; rank 0 broadcasts what counts
    session = Session(run_id, prepared, None, quiet=True, control=control, ranks=ranks)
    session.reporter = Reporter(Path(os.devnull), session.total_steps, 0, quiet=True)
    if resuming:
        ckpt = session.agreed_checkpoint()  # in step with rank 0's _resume_state
        if ckpt is not None:
            session.restore(ckpt)
    status = train(session)
    if status == "paused":  # as rank 0 does: give the memory back now
        sys.stdout.flush()
        os._exit(0)
    return status


def _execute(run_id: str, prepared: Prepared, *, resuming: bool, quiet: bool, ranks: Ranks,
             taken: tuple[Control, RunLock] | None) -> str:
    from .train.loop import train

    folder = run_dir(run_id)
    control, lock = taken or take_run(run_id)
    ledger = Ledger()
    try:
        session = Session(run_id, prepared, ledger, quiet=quiet, control=control, ranks=ranks)
    except Exception as exc:  # e.g. out of memory while loading: recorded, not silently left "created"
        ledger.set_status(run_id, "failed", error=f"{type(exc).__name__}: {exc}", step=0)
        ledger.close()
        lock.release()
        raise
    session.reporter = reporter = _reporter(session, quiet)

    def on_hold(request: dict) -> None:
        ledger.set_status(run_id, "held", "held", step=session.progress.step, by=request.get("by"),
                          reason=request.get("reason"))
        reporter.held(request.get("by"), request.get("reason"))

    def on_continue(request: dict, held: float) -> None:
        ledger.set_status(run_id, "running", "continued", step=session.progress.step, by=request.get("by"),
                          held_seconds=round(held, 3))
        reporter.continued(held)

    session.control.on_hold, session.control.on_continue = on_hold, on_continue
    try:
        stale = session.store.clean_stale()
        if stale:
            reporter.message(f"removed {len(stale)} unfinished checkpoint folder(s)")
        session.store.prune()  # a crash between a commit and its prune leaves one too many
        run = ledger.run(run_id)
        session.resumed_from = (0, 0)
        if resuming:
            _resume_state(session, run)
        session.progress.segment = run["segment"] + 1 if resuming else 0
        record = session.provenance()
        ledger.add_provenance(run_id, session.progress.segment, record)
        _write_provenance_json(folder, ledger.provenance(run_id))
        ledger.update_run(run_id, pid=os.getpid(), segment=session.progress.segment)
        earlier = segment_compute(ledger.events(run_id))
        session.prior_cpu_seconds = sum(seg.get("cpu_seconds") or 0.0 for seg in earlier)
        session.prior_wall_seconds = sum(seg.get("wall_seconds") or 0.0 for seg in earlier)
        lost = {"lost_after_step": session.resumed_from[1]} if resuming else {}
        ledger.set_status(run_id, "running", "resumed" if resuming else "started",
                          step=session.progress.step, segment=session.progress.segment, pid=os.getpid(),
                          threads=session.job.training.threads, limits=session.applied_limits, **lost,
                          **({"world_size": ranks.world_size} if ranks.world_size > 1 else {}))
        session.control.announce("running")
        reporter.message(f"run {run_id}: {'resuming at' if resuming else 'starting at'} step "
                         f"{session.progress.step}/{session.total_steps} "
                         f"({len(prepared.train_indices)} train / {len(prepared.eval_indices)} eval examples, "
                         f"{plural(session.job.training.threads, 'thread')}"
                         + (f" x {ranks.world_size} processes)" if ranks.world_size > 1 else ")"))
        reporter.started(session.progress.step)
        status = train(session)
        compute = session.meter.read()
        if status == "finished":
            adapter = session.write_adapter()
            final_eval = session.evals.get(session.progress.step)
            ledger.update_run(run_id, pid=None)
            ledger.set_status(run_id, "finished", step=session.progress.step, eval_loss=final_eval,
                              adapter=str(adapter), compute=compute)
            reporter.message(f"finished: {session.progress.step} steps; adapter in {adapter}")
        elif status == "paused":
            request = session.control.release or {}
            ledger.update_run(run_id, pid=None)
            ledger.set_status(run_id, "paused", step=session.progress.step, by=request.get("by"),
                              reason=request.get("reason"), compute=compute)
            reporter.message(f"paused at step {session.progress.step} ({request.get('by')}: {request.get('reason')}); "
                             f"checkpoint committed; continue with `lodger resume {run_id}`")
        else:
            ledger.update_run(run_id, pid=None)
            ledger.set_status(run_id, "interrupted", step=session.progress.step,
                              reason=session.control.stop, compute=compute)
            reporter.message(f"interrupted ({session.control.stop}) at step {session.progress.step}; "
                             f"continue with `lodger resume {run_id}`")
        session.control.announce(status)
        if status == "paused":
            # Give the machine back now: skip interpreter teardown (seconds of freeing torch and
            # friends). The kernel drops the run lock only when the process is gone, so whoever
            # waits on the lock sees the memory truly free.
            reporter.close()
            ledger.close()
            limit = (session.control.release or {}).get("by") == "limit"
            if limit:
                print(f"error: run {run_id} stopped: {session.control.release.get('reason')}; its checkpoint "
                      f"at step {session.progress.step} is committed", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(LimitReached.exit_code if limit else 0)
        return status
    except BaseException as exc:
        if not isinstance(exc, KeyboardInterrupt):
            ledger.update_run(run_id, pid=None)
            ledger.set_status(run_id, "failed", error=f"{type(exc).__name__}: {exc}", step=session.progress.step)
        raise
    finally:
        reporter.close()
        ledger.close()
        lock.release()


def apply_limits(limits) -> dict:
    """Lower this process's CPU and I/O priority and cap GPU memory; return what was applied."""
    applied: dict = {}
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        if limits.nice > current:
            os.setpriority(os.PRIO_PROCESS, 0, limits.nice)
        applied["nice"] = os.getpriority(os.PRIO_PROCESS, 0)
    except OSError as exc:
        applied["nice_error"] = str(exc)
    if limits.ionice_idle:
        try:
            import psutil

            psutil.Process().ionice(psutil.IOPRIO_CLASS_IDLE)
            applied["ionice"] = "idle"
        except (ImportError, OSError, AttributeError, ValueError) as exc:
            applied["ionice_error"] = str(exc)
    if limits.gpu_memory_fraction:
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(limits.gpu_memory_fraction)
            applied["gpu_memory_fraction"] = limits.gpu_memory_fraction
    if limits.memory_gb:
        applied["memory_gb"] = limits.memory_gb
    if limits.max_compute_hours:
        applied["max_compute_hours"] = limits.max_compute_hours
    return applied


def _reporter(session: Session, quiet: bool):
    from .report import Reporter

    return Reporter(session.dir / "log.txt", session.total_steps, 0, quiet=quiet)


def _resume_state(session: Session, run: dict) -> None:
    def damaged(path: Path, reason: str, aside: Path) -> None:
        session.ledger.event(session.run_id, "damaged_checkpoint", checkpoint=path.name, reason=reason,
                             moved_to=aside.name)
        session.reporter.message(f"warning: checkpoint {path.name} is damaged ({reason}); moved aside to "
                                 f"{aside.name}, using the previous one")

    ckpt = session.agreed_checkpoint(on_damaged=damaged)
    if ckpt is None:
        session.reporter.message("no usable checkpoint: starting again from step 0")
        session.resumed_from = (0, session.truncate_metrics(-1))
        return
    state = json.loads(ckpt.files["state.json"])
    for key, now in (("train_sha256", session.p.train_file.sha256),
                     ("eval_sha256", session.p.eval_file.sha256 if session.p.eval_file else None)):
        if state["data"][key] != now:
            raise RunStateError(f"run {session.run_id}: the data file changed since the checkpoint "
                                f"({key.split('_')[0]}: recorded {state['data'][key]}, now {now}); "
                                "restore the original file or start a new run")
    if state["model_sha256"] != session.p.source.sha256:
        raise RunStateError(f"run {session.run_id}: the model changed since the checkpoint (recorded "
                            f"{state['model_sha256']}, now {session.p.source.sha256})")
    differences = session.restore(ckpt)
    session.resumed_from = (ckpt.step, session.truncate_metrics(ckpt.step))
    recovered = complete_ledger(session.ledger, session.run_id, session.dir, ckpt)
    if recovered["checkpoint"] or recovered["metrics"]:
        session.reporter.message(f"ledger completed from the run folder: {recovered['metrics']} metric line(s)"
                                 + (f", checkpoint {ckpt.path.name} recorded" if recovered["checkpoint"] else ""))
    if differences:
        session.ledger.event(session.run_id, "drift", step=ckpt.step, differences=differences)
        session.reporter.message("warning: resuming on a different setup; the result is no longer bitwise "
                                 "comparable with the uninterrupted run:\n  " + "\n  ".join(differences))
    session.reporter.message(f"restored checkpoint {ckpt.path.name}")


def _state_problems(state: dict, step: int) -> list[str]:
    """What a checkpoint's state.json lacks for ``restore`` and ``_resume_state`` (which read these keys)."""
    from dataclasses import fields

    problems = [f"state.json lacks `{k}`" for k in ("progress", "rng", "numerics", "data", "model_sha256")
                if k not in state]
    progress, data, rng = state.get("progress"), state.get("data"), state.get("rng")
    if isinstance(rng, dict):
        problems += [f"state.json lacks `rng.{k}`" for k in ("python", "numpy") if k not in rng]
    elif "rng" in state:
        problems.append("state.json `rng` is not an object")
    if isinstance(progress, dict):
        problems += [f"state.json lacks `progress.{f.name}`" for f in fields(Progress) if f.name not in progress]
        if "step" in progress and progress["step"] != step:
            problems.append(f"state.json says step {progress['step']!r}, its folder step {step}")
    elif "progress" in state:
        problems.append("state.json `progress` is not an object")
    if isinstance(data, dict):
        problems += [f"state.json lacks `data.{k}`" for k in ("train_sha256", "eval_sha256") if k not in data]
    elif "data" in state:
        problems.append("state.json `data` is not an object")
    return problems


def _write_provenance_json(folder: Path, segments: list[dict]) -> None:
    durable.atomic_write(folder / "provenance.json",
                         json.dumps({"segments": segments}, indent=1, sort_keys=True, default=str).encode())


def resume_prepared(run_id: str, threads: int | None = None, world_size: int | None = None) -> Prepared:
    """Re-validate a run's recorded job for resuming (optionally at another thread count or world size)."""
    path = run_dir(run_id) / JOB_FILE
    if not path.exists():
        raise RunStateError(f"run {run_id}: its job file {path} is missing; the ledger holds a copy "
                            f"(`job_toml` in `lodger show {run_id} --json`): write it back to that path")
    job = load_job(path)
    if threads is not None:
        job.training.threads = threads
    if world_size is not None:
        job.training.world_size = world_size
    return prepare(job)
