"""`lodger demo`: fine-tune SmolLM2 on the bundled data and show what changed."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import click


def _demo_job(folder: Path, steps: int, threads: int) -> Path:
    from ..tomlfile import to_toml

    data = resources.files("lodger") / "demo"
    job = {
        "name": "demo",
        "model": {"source": "smollm2-135m-instruct"},
        "method": {"kind": "lora", "rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]},
        "data": {"train": str(data / "train.jsonl"), "eval": str(data / "eval.jsonl"), "max_length": 128},
        "training": {"steps": steps, "batch_size": 8, "learning_rate": 1e-3, "warmup_steps": 5,
                     "threads": threads, "eval_every": max(steps // 2, 1), "log_every": 10},
        "checkpoints": {"every_steps": 20, "keep_last": 2},
    }
    path = folder / "demo.toml"
    path.write_text(to_toml(job))
    return path


@click.command()
@click.option("--steps", type=click.IntRange(1), default=80, show_default=True, help="Optimizer steps.")
@click.option("--threads", type=click.IntRange(1), default=None, help="CPU threads (default: all cores).")
def demo(steps: int, threads: int | None) -> None:
    """Fine-tune SmolLM2-135M-Instruct with LoRA on the bundled data, then show before and after.

    Prints the answers to held-out prompts before and after training, the eval loss before and
    after, and where the adapter is. Takes a few minutes on 2 CPU cores.

    Example: lodger demo --steps 80
    """
    from ..home import home, run_dir
    from ..ledger import Ledger
    from ..launch import start
    from ..run import create_run

    threads = threads or len(os.sched_getaffinity(0))
    folder = home() / "demo"
    folder.mkdir(exist_ok=True)
    job_path = _demo_job(folder, steps, threads)
    prompts = json.loads((resources.files("lodger") / "demo" / "prompts.json").read_text())
    click.echo(f"job file: {job_path}")
    run_id, prepared = create_run(job_path)
    click.echo(f"run {run_id}")
    status = start(run_id, prepared, resuming=False)
    if status != "finished":
        click.echo(f"demo {status}; continue it with `lodger resume {run_id}`")
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


def _answers(folder: Path, adapter: Path, prompts: list[str], threads: int) -> tuple[list[str], list[str]]:
    """Greedy answers without and with the adapter, loaded with plain peft."""
    import torch
    from peft import PeftModel

    from ..model import generate_reply, load_base_model, load_tokenizer

    torch.set_num_threads(threads)
    tokenizer = load_tokenizer(folder)
    model = PeftModel.from_pretrained(load_base_model(folder), str(adapter))
    model.eval()
    with model.disable_adapter():
        before = [generate_reply(model, tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    after = [generate_reply(model, tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    return before, after


COMMANDS = [demo]
