"""`lodger demo`: fine-tune SmolLM2 on the bundled data and show what changed.

The quick demo (the default) is sized to finish well inside 5 minutes on an idle 2-core machine
and still show the lesson: after 40 steps the model answers in the bundled chats' house style
("Lodger says: ... Cheers, Lodger.") and the eval loss has fallen from 3.12 to 0.17
(bench/demo_time.py measures it; README.md has the figures). `--long` is the earlier 80-step demo.
"""

from __future__ import annotations

import json
import os
import time
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from ..lifecycle.run import Run

MODEL = "smollm2-135m-instruct"
QUICK = {"steps": 40, "eval_every": 20, "log_every": 5}
LONG = {"steps": 80, "eval_every": 40, "log_every": 10}

# The forecast: training steps from the estimator (memory.estimate_time, the matmul rate measured
# just now), the rest as multiples of one such step, calibrated on this project's 2-core machine
# (bench/demo_time.py prints forecast and outcome side by side).
EVAL_EXAMPLE_STEPS = 0.05   # one eval example's forward pass, in training steps of batch 8 (0.6 s / 8 / 1.45 s)
ANSWER_STEPS = 1.0          # one greedy answer of up to 48 tokens, in training steps (0.5-2.4 s / 1.45 s)
FIXED_SECONDS = 12.0        # starting, loading the model twice, writing the adapter and checkpoints
CONVERT_SECONDS_PER_MIB = 0.2  # the GGUF conversion (17 s for SmolLM2's 94 MiB, one core)


def _demo_job(folder: Path, plan: dict, threads: int, model: str) -> Path:
    from .. import durable
    from ..config.tomlfile import to_toml

    data = resources.files("lodger") / "demo"
    job = {
        "name": "demo",
        "model": {"source": model},
        "method": {"kind": "lora", "rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]},
        "data": {"train": str(data / "train.jsonl"), "eval": str(data / "eval.jsonl"), "max_length": 128},
        "training": {"steps": plan["steps"], "batch_size": 8, "learning_rate": 1e-3, "warmup_steps": 5,
                     "threads": threads, "eval_every": plan["eval_every"], "log_every": plan["log_every"]},
        "checkpoints": {"every_steps": 20, "keep_last": 2},
    }
    path = folder / "demo.toml"
    durable.atomic_write(path, to_toml(job).encode())
    return path


@click.command()
@click.option("--long", "long_demo", is_flag=True, help="The longer demo: 80 steps, about twice the training time.")
@click.option("--steps", type=click.IntRange(1), default=None,
              help="Optimizer steps (default 40, or 80 with --long); evals at the start, half-way and the end.")
@click.option("--threads", type=click.IntRange(1), default=None,
              help="CPU threads (default: every core, or those other work leaves free).")
@click.option("--model", default=MODEL, show_default=True,
              help="The model to fine-tune: an alias, a .gguf file or a Hugging Face folder with a chat template.")
def demo(long_demo: bool, steps: int | None, threads: int | None, model: str) -> None:
    """Fine-tune SmolLM2-135M-Instruct with LoRA on the bundled data, then show before and after.

    Says up front how long it expects to take here (from a matmul benchmark it runs first), then
    trains, then prints the answers to held-out prompts before and after training, the eval loss
    before and after, and what to try next with the run it made. About 1.5 minutes on an idle 2-core
    machine (1:39 the first time, converting the model included); `--long` trains twice as long.

    \b
    Example: lodger demo
             lodger demo --long
    """
    from .. import durable
    from ..home import home
    from ..reporting.report import Phase

    began = time.monotonic()
    if Path(model).expanduser().exists():  # the job file lives elsewhere: a path must not depend on the cwd
        model = str(Path(model).expanduser().resolve())
    threads, why = (threads, "") if threads else _threads_for_now()
    plan = dict(LONG if long_demo else QUICK)
    if steps is not None:
        plan.update(steps=steps, eval_every=max(steps // 2, 1), log_every=max(1, min(10, steps // 8)))
    folder = durable.make_dirs(home() / "demo")
    job_path = _demo_job(folder, plan, threads, model)
    nice = _lower_priority(job_path)
    prompts = json.loads((resources.files("lodger") / "demo" / "prompts.json").read_text())
    click.echo(f"lodger demo: LoRA fine-tuning of {model} on the bundled chats, {plan['steps']} steps on "
               f"{plan_threads(threads)}{why}; job file {job_path}")
    first_use = _prepare_model(model)
    with Phase("measuring the training runtime's memory (first use: a fresh process imports torch)"):
        from ..memory.estimate import runtime_bytes

        runtime_bytes(threads=threads, use_current=False)  # cached; create_run's pre-flight reads it
    with Phase("checking and tokenising the data, estimating the memory"):
        from ..lifecycle.run import Run

        new = Run.create(job_path)
        run_id, prepared = new.run_id, new.prepared
    with Phase("measuring this machine (a matmul benchmark) for the forecast"):
        from ..train.throughput import rate_record

        rate = rate_record(threads, prepared.job.training.precision, prepared.device, fresh=True)
    forecast = _forecast(prepared, rate, len(prompts))
    click.echo(_forecast_text(forecast, rate, first_use, threads, nice))
    click.echo(f"run {run_id}")
    _train_and_show(new, prompts, threads, job_path, began, sum(forecast.values()) + first_use)


def _threads_for_now() -> tuple[int, str]:
    """(threads, why): every core while the machine is quiet; while other work keeps cores busy,
    the cores it leaves (at least one). Two threads on a 2-core machine that something else keeps
    busy wait for each other at every matrix multiply: measured here, a demo step took 13-25 s on
    2 threads against 2.7 s on 1 (1.45 s on 2 idle cores)."""
    from ..train.throughput import cores_in_use

    cores = len(os.sched_getaffinity(0))
    samples = [cores_in_use(0.5) for _ in range(2)]  # the quieter of two: a burst is not a busy machine
    busy = None if None in samples else min(samples)
    if busy is None or busy <= 0.5:
        return cores, ""
    threads = max(1, min(cores, round(cores - busy)))
    if threads == cores:
        return cores, ""
    return threads, (f" (other work keeps {busy:.1f} of the {cores} cores busy; threads that wait for each other "
                     f"lose more than the missing cores: `--threads {cores}` to insist)")


def _lower_priority(job_path: Path) -> int:
    """The job's [limits] nice for the whole demo from its start, before torch starts its threads
    (they keep the priority they are started with): training lowers it anyway, so the forecast's
    benchmark measures what the run will get, and converting the model is as kind to the
    machine's other work as training is. Returns the nice value in force."""
    from ..lifecycle.jobfile import load_job

    nice = load_job(job_path).limits.nice
    try:
        if nice > os.getpriority(os.PRIO_PROCESS, 0):
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        return os.getpriority(os.PRIO_PROCESS, 0)
    except OSError:  # not permitted here: the run says what it applied
        return nice


def plan_threads(threads: int) -> str:
    from ..reporting.report import plural

    return plural(threads, "thread")


def _prepare_model(model: str) -> float:
    """Convert a GGUF model on its first use, saying so; the seconds it took (0: nothing to do)."""
    from ..home import cache_dir
    from ..model import model_folder, preparation_notice, resolve_source
    from ..reporting.report import Phase

    source = resolve_source(model)
    if preparation_notice(source) is None:
        return 0.0
    size = source.path.stat().st_size / 2**20
    click.echo(f"first use of {model}: its GGUF file ({size:.0f} MiB) is converted once into a Hugging Face "
               f"folder in {cache_dir('models')}; later runs skip this")
    with Phase(f"converting {model}", expected=max(5.0, size * CONVERT_SECONDS_PER_MIB), after=0.0) as phase:
        model_folder(source)
    return phase.seconds


def _forecast(prepared, rate: dict, answers: int) -> dict[str, float]:
    """Seconds each part of the demo should take here: the estimator's step time at the matmul
    rate just measured, and the evals, answers and fixed costs in proportion (see the constants)."""
    from ..memory.estimate import estimate_time
    from .estimate import batch_shapes

    job = prepared.job
    config = json.loads((prepared.folder / "config.json").read_text())
    _, width, _ = batch_shapes(job, prepared)
    _, step, _ = estimate_time(job, config, rate["flops_per_second"], seq_len=width)
    total, every = prepared.total_steps, job.training.eval_every
    evals = len({0, total} | ({s for s in range(every, total, every)} if every else set()))
    examples = len(prepared.eval_indices)
    return {"training": step * total, "evals": evals * examples * EVAL_EXAMPLE_STEPS * step,
            "answers": 2 * answers * ANSWER_STEPS * step, "loading": FIXED_SECONDS}


def _forecast_text(forecast: dict[str, float], rate: dict, first_use: float, threads: int, nice: int) -> str:
    from ..reporting.report import clock
    from ..lifecycle.runview import rate_conditions

    parts = ", ".join(f"{name} {clock(seconds)}" for name, seconds in forecast.items())
    done = f" (after the {first_use:.0f} s of converting the model)" if first_use else ""
    text = (f"expected: about {clock(sum(forecast.values()))} from here{done}: {parts}; from a "
            f"{rate['seconds']:.1f} s matmul benchmark just now: {rate['flops_per_second'] / 1e9:.1f} GFLOP/s "
            f"on {plan_threads(threads)} at nice {nice}, {rate_conditions(rate)}")
    if not rate["quiet"]:
        why = [f"at nice {nice} the machine's other work comes first ([limits] nice)"] if nice > 0 else []
        if threads > 1:
            why.append("training threads that wait for each other lose more than the benchmark did")
        text += "\n  the machine is busy, so expect longer" + (": " + "; ".join(why) if why else "")
    return text


def _train_and_show(demo_run: Run, prompts: list[str], threads: int, job_path: Path, began: float,
                    expected: float) -> None:
    from ..home import run_dir
    from ..ledger import Ledger
    from ..reporting.report import clock
    from ..reporting.report import Phase

    run_id, prepared = demo_run.run_id, demo_run.prepared
    # ends when the run's own live line starts (report.hand_over): loading, the attention probe
    with Phase("loading the model and starting the run"):
        outcome = demo_run.start(resuming=False)
    if not outcome.finished:
        click.echo(f"demo {outcome.status}; continue it with `lodger resume {run_id}`")
        return
    with Ledger() as ledger:
        evals = ledger.metrics(run_id, "eval")
    adapter = run_dir(run_id) / "adapter"
    before, after = _answers(prepared.folder, adapter, prompts, threads)
    click.echo("")
    for prompt, old, new in zip(prompts, before, after):
        click.echo(f"prompt: {prompt}\n  before: {old}\n  after:  {new}\n")
    if evals:
        click.echo(f"eval loss: before {evals[0]['eval_loss']:.4f} -> after {evals[-1]['eval_loss']:.4f}")
    click.echo(f"adapter (peft layout): {adapter}")
    load = os.getloadavg()[0]
    click.echo(f"demo took {clock(time.monotonic() - began)} (expected {clock(expected)}; load average now "
               f"{load:.2f} on {os.cpu_count()} CPUs)")
    click.echo(next_steps(run_id, job_path))


def next_steps(run_id: str, job_path: Path) -> str:
    """What to try next, as commands for the run just made (comments say what each shows)."""
    return "\n".join([
        "",
        f"try next, with this run ({run_id}):",
        "  # kill a run and resume it: a second run of this job, in the background, prints its id (NEW) and pid (PID)",
        f"  lodger run {job_path} --detach",
        "  kill -9 PID; lodger resume NEW",
        "  # compare: bitwise equal to this run, kill and all",
        f"  lodger compare NEW {run_id}",
        "  # chat with it (an empty line ends), or serve it: an OpenAI-compatible API on 127.0.0.1:8000",
        f"  lodger chat {run_id}",
        f"  lodger serve --run {run_id}",
        "  # export it: the peft adapter, and a GGUF file for llama.cpp / Ollama",
        f"  lodger export {run_id} ./demo-export --format peft,gguf",
        "  # look at it: progress, checkpoints, the matmul rate MFU divides by, events",
        f"  lodger show {run_id}",
        "  # or in a browser: every run live, its curves, compare, pause; open the URL it prints",
        "  # (http://127.0.0.1:8765/login?token=...; docs/ui.md)",
        "  lodger ui",
        "  # its numbers in TensorBoard and MLflow (pip install 'lodger[trackers]')",
        f"  lodger report {run_id} --to tensorboard,mlflow",
    ])


def _answers(folder: Path, adapter: Path, prompts: list[str], threads: int) -> tuple[list[str], list[str]]:
    """Greedy answers without and with the adapter, loaded with plain peft."""
    from ..reporting.report import Phase

    with Phase(f"answering {len(prompts)} held-out prompts without and with the adapter", after=0.0) as phase:
        import torch
        from peft import PeftModel

        from ..model import generate_reply, load_base_model, load_tokenizer

        torch.set_num_threads(threads)
        tokenizer = load_tokenizer(folder)
        model = PeftModel.from_pretrained(load_base_model(folder), str(adapter))
        model.eval()
        before, after = [], []
        with model.disable_adapter():
            for prompt in prompts:
                before.append(generate_reply(model, tokenizer, [{"role": "user", "content": prompt}]))
                phase.advance(len(before), 2 * len(prompts))
        for prompt in prompts:
            after.append(generate_reply(model, tokenizer, [{"role": "user", "content": prompt}]))
            phase.advance(len(prompts) + len(after), 2 * len(prompts))
    return before, after


COMMANDS = [demo]
