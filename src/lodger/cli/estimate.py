"""Command that predicts: estimate (memory and time of a job before it runs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

GiB = 2**30

_NOTES = {
    "runtime": "torch, transformers and peft imported (measured)",
    "weights": "{total} parameters in fp32{quantised}",
    "gradients": "{trainable} trainable parameters, fp32",
    "optimizer": "AdamW: two fp32 moments per trainable parameter",
    "activations": "{checkpointing}batch {batch} x {seq} tokens",
    "reference": "the reference's log-probabilities of every example (two fp32 each)",
    "logits_and_loss": "logits, their log-softmax and gradient over {vocab} tokens",
    "checkpoint": "extra memory while a checkpoint is written (streamed from the tensors: none)",
    "buffers": "tokenizer, attention mask, kernels' scratch",
    "allocator": "memory the allocator keeps after freeing it",
    "autocast_copies": "{precision} copy of every linear weight",
    "generation": "GRPO sampling: the KV cache of {batch} ({seq} positions), decode logits",
    "rollouts": "GRPO: the step's completions laid out, with their kept log-probabilities",
    "reference_model": "GRPO's KL reference for full fine-tuning: a frozen fp32 copy of the base",
    "dequantisation": "fp32 copies of quantised weights in use (and DoRA's weight norm)",
    "quantised_load": "what quantising the base as it loads leaves resident",
}


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _longest_example(train_set) -> int:
    offsets = train_set.offsets
    return int((offsets[1:] - offsets[:-1]).max())


def packs(prepared) -> bool:
    """Whether the job packs examples into rows ([training] packing; "auto" decided from the data)."""
    return bool(getattr(prepared.planner, "packed", False))


def batch_shapes(cfg, prepared, micro_batches: int = 512) -> tuple[int, float, float]:
    """(peak row width, mean row width, padding share of the computed positions) of the job's
    micro-batches, from the first ``micro_batches`` of its real plan (``prepared.planner``: its
    order, shuffled or length-grouped, and its layout, padded to each micro-batch's longest example
    or packed into rows as the run lays them out). Widths are per example slot (a micro-batch's
    positions over batch_size), the shape the estimate counts in: a packed micro-batch of one row
    computes what batch_size rows would."""
    from ..data.packing import example_lengths

    lengths = example_lengths(prepared.train_set)
    planner, batch = prepared.planner, cfg.training.batch_size
    batches: list[list[int]] = []
    position = 0
    while len(batches) < micro_batches:
        plan = planner.plan(position)
        batches += [[sum(lengths[i] for i in row) for row in pack] for pack in plan.packs]
        position = plan.end
        if position >= len(planner.sampler):  # the first epoch is enough
            break
    batches = batches[:micro_batches]
    if packs(prepared):
        peak = cfg.data.max_length  # at most batch_size x max_length positions a micro-batch
    else:
        peak = min(cfg.data.max_length, _longest_example(prepared.train_set))
    computed = sum(len(b) * max(b) for b in batches)
    widths = computed / batch / len(batches)
    return peak, widths, 1 - sum(map(sum, batches)) / computed


@click.command()
@click.argument("job", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--measure", is_flag=True,
              help="Also run 3 real training steps at the job's shape in a fresh process and compare "
                   "(minutes for a real model).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def estimate(job: Path, measure: bool, as_json: bool) -> None:
    """Will JOB fit in memory, and how long will it take?

    Prints the expected peak memory item by item (from the model's config.json, the batch, the
    longest training example, the method and precision), the memory available (MemAvailable and
    [limits] memory_gb), and the expected time per step and for the whole job. With --measure,
    a few real steps run in a fresh process and their peak resident memory is compared with the
    estimate. Exits 3 when the job does not fit.

    Example: lodger estimate my-job.toml --measure
    """
    from ..memory import estimate as memory
    from ..lifecycle.jobfile import load_job
    from ..lifecycle.prepare import prepare

    cfg = load_job(job)
    import time

    from .train import announce_first_use, first_use_done

    started = time.monotonic()
    announced = announce_first_use(cfg, quiet=False)  # on stderr: --json output stays clean
    prepared = prepare(cfg)
    if announced:
        first_use_done(started)
    threads = cfg.training.threads or len(os.sched_getaffinity(0))
    model_config = json.loads((prepared.folder / "config.json").read_text())
    seq, width, padding = batch_shapes(cfg, prepared)
    gpu = prepared.device == "cuda"
    # Measured afresh here, and cached for the step line's MFU (train/throughput.py).
    rate = memory.matmul_rate(threads, cfg.training.precision, "cuda" if gpu else "cpu", fresh=True)
    # On a GPU the estimate is of GPU memory (no CPU process runtime in it), against free GPU memory.
    est = memory.estimate(cfg, model_config, seq_len=seq, flops_per_second=rate, mean_width=width,
                          total_steps=prepared.total_steps, device=prepared.device,
                          examples=memory.reference_examples(prepared),
                          runtime_bytes=None if gpu else memory.runtime_bytes(threads=threads, use_current=False))
    available = _free_gpu_memory() if gpu else memory.memory_available()
    limit = int(cfg.limits.memory_gb * GiB) if cfg.limits.memory_gb else None
    budget = min(available, limit) if limit else available
    fits = est.total_bytes <= budget
    measured = memory.measure(cfg, prepared.folder, seq_len=seq, steps=3, packed=packs(prepared)) if measure else None

    if as_json:
        out = {"estimate": est.to_dict(), "available_bytes": available, "limit_bytes": limit, "fits": fits,
               "flops_per_second": rate, "total_steps": prepared.total_steps, "packed": packs(prepared),
               "mean_width": width, "padding": padding,
               "suggestions": [] if fits else memory.suggestions(est, cfg, budget)}
        if measured:
            out["measured"] = {"peak_bytes": measured.peak_bytes, "step_seconds": measured.step_seconds,
                               "ratio": est.total_bytes / measured.peak_bytes}
        click.echo(json.dumps(out, indent=1))
    else:
        _print(job, cfg, est, model_config, rate, prepared.total_steps, available, limit, fits, budget, measured)
        click.echo(f"batches: {'packed' if packs(prepared) else 'padded'} ({cfg.training.order} order), "
                   f"{width:.0f} positions per example "
                   f"slot on average, {padding:.0%} of them padding")
    if not fits:
        raise click.exceptions.Exit(3)


def _print(path, cfg, est, model_config, rate, total_steps, available, limit, fits, budget, measured) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..memory import estimate as memory

    console = Console(highlight=False)
    shape = memory.model_shape(model_config)
    values = {"total": _count(est.total_params), "trainable": _count(est.trainable_params),
              "batch": _batch_text(cfg, est), "seq": est.seq_len, "vocab": f"{shape.vocab:,}",
              "precision": cfg.training.precision,
              "quantised": f", decoder linears in {cfg.method.base_bits} bits" if cfg.method.base_bits else "",
              "checkpointing": "checkpointed, " if cfg.training.gradient_checkpointing else ""}
    table = Table(title=f"{path}: peak memory on {est.device} ({cfg.method.kind}, {cfg.training.precision})",
                  box=None, title_justify="left")
    table.add_column("item")
    table.add_column("GiB", justify="right")
    table.add_column("")
    for name, size in est.items.items():
        style = "bold" if name == est.largest else None
        table.add_row(name, f"{size / GiB:.2f}", _NOTES.get(name, "").format(**values), style=style)
    if est.overlap_bytes:
        table.add_row("(not at once)", f"-{est.overlap_bytes / GiB:.2f}",
                      "items never resident at the same moment")
    table.add_row("total (peak)", f"{est.total_bytes / GiB:.2f}", f"largest: {est.largest}", style="bold")
    console.print(table)
    limit_text = f"; \\[limits] memory_gb {limit / GiB:.2f} GiB" if limit else ""  # rich would read [limits] as a style
    verdict = "[green]fits[/green]" if fits else "[red]does not fit[/red]"
    console.print(f"available: {available / GiB:.2f} GiB (MemAvailable){limit_text} -> {verdict}")
    if est.step_seconds is not None:
        whole = (f", about {duration(est.job_seconds)} for {total_steps} steps" if est.job_seconds else "")
        console.print(f"time: about {duration(est.step_seconds)} per step "
                      f"({est.flops_per_step / 1e12:.2f} TFLOP at a measured {rate / 1e9:.0f} GFLOP/s matmul "
                      f"rate){whole}")
    if not fits:
        for line in memory.suggestions(est, cfg, budget):
            console.print(f"  - {line}", markup=False)
    if measured:
        ratio = est.total_bytes / measured.peak_bytes
        per_step = sum(measured.step_seconds[1:]) / max(1, len(measured.step_seconds) - 1)
        console.print(f"measured: peak resident {measured.peak_bytes / GiB:.2f} GiB over "
                      f"{len(measured.step_seconds)} steps ({per_step:.1f} s/step); "
                      f"estimate / measured = {ratio:.2f}")


def _batch_text(cfg, est) -> str:
    from ..memory import estimate as memory

    if cfg.method.objective == "grpo":
        return f"{est.batch_size} prompts x {cfg.grpo.num_generations} completions"
    if memory.sequences_per_example(cfg.method) == 1:
        return str(est.batch_size)
    return f"{est.batch_size} pairs ({2 * est.batch_size} sequences)"


COMMANDS = [estimate]


def _free_gpu_memory() -> int:
    import torch

    return torch.cuda.mem_get_info()[0]
