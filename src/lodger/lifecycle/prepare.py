"""A job made ready to train, before anything is written: every data line validated, the model
resolved and cached, the data tokenised, the step plan made (``Prepared``, the one value every
later stage takes as it is), and the memory pre-flight that refuses a job that will not fit."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, cast

from ..config import JobConfig
from ..data.chats import DataFile, TokenizedSet, make_sampler, read_jsonl, split_indices, tokenize
from ..errors import PreflightError, RunStateError
from ..home import refuse_links_out, run_dir
from .jobfile import load_job
from ..model import ModelSource, check_target_modules, model_folder, resolve_source, tokenizer_hash
from ..data.packing import example_lengths, make_planner
from ..data.preference import row_checker, tokenize_preference

JOB_FILE = "job.toml"


@dataclass(frozen=True)
class Prepared:
    """Everything validated before a run folder exists (``prepare_job``): one value, taken as it is
    by every later stage."""

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
    planner: Any = None  # packing.Packer or PaddedPlanner: each step's examples from its position


def prepare(job: JobConfig, device: str | None = None) -> Prepared:
    """Validate data (every line), resolve and cache the model, tokenise. Writes only caches.

    ``device`` skips choosing one here: the gate prepares a job for another machine's device."""
    from ..model import load_tokenizer
    from ..train.determinism import pick_device

    objective = job.method.objective
    check: Callable[..., Any] | None = None
    encode: Callable[..., Any] = tokenize
    if objective == "grpo":  # prompt lines (data/prompts.py); every reward function loaded once, before anything is written
        from ..data.prompts import check_row, tokenize_prompts
        from ..rewards import Rewards

        check, encode = check_row, tokenize_prompts
        rewards = Rewards(job.rewards, job.grpo)
        try:
            rewards.check()
        finally:
            rewards.close()
    elif objective != "sft":  # preference lines (data/preference.py): their own shape and tokenisation
        check = row_checker(objective)
        encode = partial(tokenize_preference, objective=objective, kl_block=job.training.batch_size)
    train_file = read_jsonl(job.data.train, check)
    eval_file = read_jsonl(job.data.eval, check) if job.data.eval is not None else None
    source = resolve_source(job.model.source)
    here = device is None  # a device named by the gate is another machine's: its library is not this one's
    device = device or pick_device(job)
    quantisation_problem(job, source, device if here else None)
    folder = model_folder(source)
    tokenizer = load_tokenizer(folder)
    tok_sha = tokenizer_hash(folder)
    check_target_modules(folder, job.method)
    train_set = encode(train_file, tokenizer, tok_sha, job.data.max_length)
    if eval_file is not None:
        eval_set = encode(eval_file, tokenizer, tok_sha, job.data.max_length)
        train_indices, eval_indices = list(range(len(train_set))), list(range(len(eval_set)))
    else:
        train_indices, eval_indices = split_indices(len(train_set), job.data.eval_fraction, job.training.seed)
        eval_set = train_set if eval_indices else None
    # Packed or not is settled here, from the data ("auto": by the unpacked padding share); packed
    # or not, the steps hold the same examples, so the step count is the same. The attention probe
    # at start only picks how packed examples are kept apart (lifecycle/session.py).
    lengths = example_lengths(train_set)
    sampler = make_sampler(job.training, train_indices, lengths)  # [training] order
    # A packed row must hold a whole example: a pair is two sequences of up to max_length each.
    longest = job.data.max_length * getattr(train_set, "per_example", 1)
    packing = False if objective == "grpo" else job.training.packing  # completions are sampled per step, padded
    planner = make_planner(job.training, longest, sampler, lengths, packing, device)
    epochs = cast(float, job.training.epochs)  # set when steps is not (config)
    steps = job.training.steps or planner.steps_for(epochs * len(train_indices))
    return Prepared(job, source, folder, tokenizer, tok_sha, train_file, eval_file, train_set, eval_set,
                    train_indices, eval_indices, steps, device, planner)


def quantisation_problem(job: JobConfig, source: ModelSource, device: str | None) -> None:
    """[method] base_bits refused before anything is written: on a GGUF file (already quantised;
    lodger dequantises it, and quantising that again stacks two rounding errors), or on a device
    bitsandbytes cannot serve here (``device`` None: the job is prepared for another machine)."""
    from ..errors import JobFileError

    bits = job.method.base_bits
    if bits is None:
        return
    if source.kind == "gguf":
        raise JobFileError(f"[method] base_bits = {bits} with [model] source = {job.model.source!r}: a GGUF file is "
                           "already quantised (lodger trains on it dequantised to fp32), and quantising that again "
                           "would stack a second rounding error on the first; use the original model's folder or "
                           "hub id as the source, or remove base_bits")
    from ..quant import device_problem

    problem = device_problem(bits, device) if device else None
    if problem:
        raise JobFileError(problem)


def prepare_job(path: Path, *, threads: int | None = None, world_size: int | None = None) -> Prepared:
    """A job file as the one value every later stage takes as it is: read and validated (user
    defaults, datasets), the thread count settled (every core when left out; recorded), then
    ``prepare``d (data, model, tokens, the step plan)."""
    job = load_job(path)
    if threads is not None:
        job.training.threads = threads
    if world_size is not None:
        job.training.world_size = world_size
    if job.training.threads is None:
        job.training.threads = len(os.sched_getaffinity(0))
    return prepare(job)


def preflight(prepared: Prepared, force: bool = False) -> dict[str, Any]:
    """Estimate peak memory; refuse (before anything is written) a job that will not fit."""
    from ..memory.estimate import estimate, memory_available, reference_examples, runtime_bytes, suggestions

    job = prepared.job
    config = json.loads((prepared.folder / "config.json").read_text())
    longest = int((prepared.train_set.offsets[1:] - prepared.train_set.offsets[:-1]).max())
    if prepared.planner is not None and prepared.planner.packed:  # rows fill up to the token budget
        longest = prepared.planner.row_tokens
    runtime = None if prepared.device == "cuda" else runtime_bytes(threads=job.training.threads, use_current=False)
    est = estimate(job, config, seq_len=min(longest, job.data.max_length), device=prepared.device,
                   runtime_bytes=runtime, examples=reference_examples(prepared))
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



def resume_prepared(run_id: str, threads: int | None = None, world_size: int | None = None) -> Prepared:
    """Re-validate a run's recorded job for resuming (optionally at another thread count or world size)."""
    refuse_links_out(run_dir(run_id), f"run {run_id}")
    path = run_dir(run_id) / JOB_FILE
    if not path.exists():
        raise RunStateError(f"run {run_id}: its job file {path} is missing; the ledger holds a copy "
                            f"(`job_toml` in `lodger show {run_id} --json`): write it back to that path")
    return prepare_job(path, threads=threads, world_size=world_size)
