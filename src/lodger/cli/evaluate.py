"""`lodger eval`: score a run and its base model with EleutherAI's lm-evaluation-harness."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

DEFAULT_TASKS = "lodger_demo"  # lodger.evaluation.harness.DEFAULT_TASKS, repeated so --help imports nothing


@click.command(name="eval")
@click.argument("run_id", metavar="RUN")
@click.option("--tasks", "task_names", default=DEFAULT_TASKS, show_default=True, metavar="NAMES",
              help="lm-eval tasks, groups or tags, separated by commas. Their data must be in the local "
                   "datasets cache: nothing is downloaded.")
@click.option("--include", "include", multiple=True, type=click.Path(file_okay=False, path_type=Path),
              help="A folder of lm-eval task YAML files of your own (repeatable).")
@click.option("--limit", type=click.IntRange(1), help="Score at most this many examples per task (recorded).")
@click.option("--checkpoint", "checkpoint", type=click.IntRange(0), metavar="STEP",
              help="Score this committed checkpoint instead of the run's final adapter.")
@click.option("--no-base", is_flag=True, help="Score only the trained weights, not the base model beside them.")
@click.option("--again", is_flag=True, help="Score again what the ledger already holds scores for.")
@click.option("--threads", type=click.IntRange(1, 1024), help="CPU threads (default: the run's [training] threads).")
@click.option("--batch-size", type=click.IntRange(1, 4096), default=8, show_default=True,
              help="Requests per forward pass.")
@click.option("--chat-template", is_flag=True, help="Wrap each prompt in the tokenizer's chat template (recorded).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def evaluate(run_id: str, task_names: str, include: tuple[Path, ...], limit: int | None, checkpoint: int | None,
             no_base: bool, again: bool, threads: int | None, batch_size: int, chat_template: bool,
             as_json: bool) -> None:
    """Score RUN's trained weights and its base model with lm-eval, and record the scores.

    Runs EleutherAI's lm-evaluation-harness in this process on the model lodger loads for the run:
    its base (the GGUF default or a Hugging Face folder) and, on top, the run's final adapter or
    one checkpoint's. Each model's scores go to the ledger with the harness version, each task's
    config and data hashes, metrics with standard errors, samples and the settings; `lodger compare`
    shows them side by side. Scores already recorded the same way are reused.

    The default tasks (lodger_demo) are two tiny multiple-choice tasks built from the bundled demo
    eval data. A task of lm-eval's (e.g. arc_easy) works when its data is in the local datasets
    cache. While it runs, the evaluation yields like training: `lodger pause RUN --hold` holds it
    in memory, `lodger resume RUN` continues it, `lodger pause RUN` (or the agent, by the run's
    [policy]) gives the machine back; run the command again to score what is left.

    \b
    Example: lodger eval my-job-20261129-101500-ab12
    Example: lodger eval my-job-20261129-101500-ab12 --tasks arc_easy --limit 200 --checkpoint 120
    """
    from ..evaluation.run import evaluate_run

    names = [n.strip() for n in task_names.split(",") if n.strip()]
    if not names:
        raise click.UsageError("--tasks: name at least one task")
    terminal = sys.stderr if as_json else sys.stdout  # as it is now: lm-eval's output is sent elsewhere meanwhile
    say = lambda line: click.echo(line, file=terminal)  # noqa: E731
    outcome = evaluate_run(run_id, tasks=names, include=list(include), limit=limit, checkpoint=checkpoint,
                           with_base=not no_base, again=again, threads=threads, batch_size=batch_size,
                           chat_template=chat_template, say=say)
    if as_json:
        click.echo(json.dumps({"run": outcome.run_id, "harness": outcome.harness, "complete": outcome.complete,
                               "stopped": outcome.stopped, "reused": outcome.reused, "scores": outcome.scores},
                              indent=1, default=str))
        return
    _print_table(outcome)
    if outcome.stopped:
        click.echo(f"not finished: {outcome.stopped['label']} gave way to {outcome.stopped['by']} "
                   f"({outcome.stopped['reason']}); `lodger eval {outcome.run_id}` again scores what is missing")


def _print_table(outcome) -> None:
    from ..evaluation.harness import metric_text

    labels = list(outcome.scores)
    if not labels:
        return
    rows = score_rows({label: data for label, data in outcome.scores.items()})
    click.echo(f"{'task':<28} {'metric':<12} " + " ".join(f"{label:>20}" for label in labels))
    for task, metric, values in rows:
        click.echo(f"{task:<28} {metric:<12} " + " ".join(f"{metric_text(values.get(label)):>20}" for label in labels))
    click.echo(f"recorded in the ledger ({outcome.harness['name']} {outcome.harness['version']}); "
               f"`lodger compare {outcome.run_id} OTHER` sets them beside another run's")


def score_rows(scored: dict[str, dict]) -> list[tuple[str, str, dict]]:
    """(task, metric, {label: metric}) for every task and metric any of the scored models has."""
    found: dict[tuple[str, str], dict] = {}
    for label, data in scored.items():
        for part in ("tasks", "groups"):
            for task, row in (data.get(part) or {}).items():
                for metric, value in row.get("metrics", {}).items():
                    found.setdefault((task, metric), {})[label] = value
    return [(task, metric, values) for (task, metric), values in sorted(found.items())]


def summary(data: dict) -> str:
    """One line of a `harness_eval` event for `lodger show`: the model, the harness, each task's first metric."""
    from ..evaluation.harness import metric_text

    tasks = []
    for task, row in sorted((data.get("tasks") or {}).items()):
        metric = next(iter(row.get("metrics") or {}), None)
        if metric:
            tasks.append(f"{task} {metric} {metric_text(row['metrics'][metric])}")
    harness = data.get("harness") or {}
    limit = (data.get("settings") or {}).get("limit")
    return (f"{(data.get('subject') or {}).get('label')} by {harness.get('name')} {harness.get('version')}: "
            + "; ".join(tasks) + (f" (limit {limit})" if limit else ""))


COMMANDS = [evaluate]
