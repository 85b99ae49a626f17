"""Command that makes a job fit: plan (settings within a memory limit, written as a new job file)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

GiB = 2**30


@click.command()
@click.argument("job", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--memory", "memory_text", default=None,
              help="The limit to fit, e.g. 16GiB, 800MiB, 16GB (default: what the machine has available now, or "
                   "[limits] memory_gb when lower).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the chosen job (default: JOB's name with -plan, beside it).")
@click.option("--pick", type=int, default=1, show_default=True, help="Write the N-th setting of the list instead.")
@click.option("--show", "shown", type=int, default=8, show_default=True, help="How many settings that fit to list.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (every setting considered).")
def plan(job: Path, memory_text: str | None, out: Path | None, pick: int, shown: int, as_json: bool) -> None:
    """Propose settings that make JOB fit a memory limit, and write the chosen one as a new job.

    Tries the base in 8 and 4 bits ([method] base_bits, LoRA only), gradient checkpointing, smaller
    micro-batches with more accumulation (the same examples per step), and last a shorter
    max_length (longer examples are then cut); lists the settings that fit with their predicted
    peak memory and time per step (no cut first, then the fastest), and writes the first (or
    --pick N) into a new job file beside JOB. Refuses, saying by how much, when nothing fits
    (exit 2); nothing is written then.

    Example: lodger plan my-job.toml --memory 16GiB --out my-job-16g.toml
    """
    from ..memory import estimate as memory
    from ..memory import plan as planner
    from ..errors import JobFileError
    from ..lifecycle.jobfile import load_job
    from ..lifecycle.prepare import prepare
    from .estimate import batch_shapes

    asked = planner.parse_size(memory_text) if memory_text is not None else None  # before anything is loaded
    cfg = load_job(job)
    prepared = prepare(cfg)
    gpu = prepared.device == "cuda"
    if asked is not None:
        budget = asked
    else:
        budget = _free_gpu_memory() if gpu else memory.memory_available()
        if cfg.limits.memory_gb:
            budget = min(budget, int(cfg.limits.memory_gb * GiB))
    threads = cfg.training.threads or len(os.sched_getaffinity(0))
    model_config = json.loads((prepared.folder / "config.json").read_text())
    longest, width, _ = batch_shapes(cfg, prepared)
    rate = memory.matmul_rate(threads, cfg.training.precision, "cuda" if gpu else "cpu", fresh=True)
    runtime = None if gpu else memory.runtime_bytes(threads=threads, use_current=False)
    options = planner.plan(cfg, model_config, budget, longest=longest, runtime_bytes=runtime, device=prepared.device,
                           flops_per_second=rate, examples=memory.reference_examples(prepared), mean_width=width)
    fitting = [o for o in options if o.fits]
    if as_json and not fitting:
        click.echo(json.dumps({"budget_bytes": budget, "fits": False, "options": [_row(o, cfg) for o in options]}, indent=1))
    planner.refuse_if_none_fits(options, cfg, budget)
    if not 1 <= pick <= len(fitting):
        raise JobFileError(f"--pick {pick}: {len(fitting)} settings fit; choose 1 to {len(fitting)}")
    chosen = fitting[pick - 1]
    out = out or job.with_name(f"{job.stem}-plan{job.suffix or '.toml'}")
    if out.resolve() == job.resolve():
        raise JobFileError(f"--out {out}: that is the job itself; name a new file")
    planner.write_job(job, out, chosen.changes)
    if as_json:
        click.echo(json.dumps({"budget_bytes": budget, "fits": True, "chosen": pick, "written": str(out),
                               "options": [_row(o, cfg) for o in options]}, indent=1))
        return
    click.echo(f"{job}: settings that fit in {budget / GiB:.2f} GiB on {prepared.device} "
               f"({len(fitting)} of {len(options)} considered; now: {options_now(options, cfg)})")
    for index, option in enumerate(fitting[:max(shown, pick)], start=1):
        mark = "->" if index == pick else "  "
        est = option.estimate
        step = f"{est.step_seconds:.1f} s/step" if est.step_seconds is not None else "? s/step"
        cut = "  (cuts longer examples)" if option.cuts else ""
        click.echo(f"{mark} {index:2d}. {option.describe(cfg)}: peak {est.total_bytes / GiB:.2f} GiB, {step}{cut}")
    click.echo(f"wrote {out} (setting {pick}); next: lodger run {out}")


def options_now(options, cfg) -> str:
    """The job as it is: its estimate among the options (the one with no changes)."""
    current = next((o for o in options if not o.changes), None)
    if current is None:
        return "?"
    return f"peak {current.estimate.total_bytes / GiB:.2f} GiB" + ("" if current.fits else ", does not fit")


def _row(option, cfg) -> dict:
    return {"setting": option.describe(cfg), "changes": option.changes, "fits": option.fits, "cuts": option.cuts,
            "peak_bytes": option.estimate.total_bytes, "step_seconds": option.estimate.step_seconds,
            "seq_len": option.estimate.seq_len, "items": option.estimate.items}


def _free_gpu_memory() -> int:
    import torch

    return torch.cuda.mem_get_info()[0]


COMMANDS = [plan]
