"""Commands about a finished record: compare, reproduce (export is in cli/export.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import LodgerError, RunStateError


def _print_comparison(c, as_json: bool, limit: int = 12) -> None:
    from ..reporting.compare import loss_difference_text

    if as_json:
        click.echo(json.dumps(c.as_dict(), indent=1, default=str))
        return
    click.echo(f"A = {c.a}\nB = {c.b}")
    click.echo("job:          " + ("same" if not c.job_differences else
                                   "; ".join(f"{k}: {va!r} vs {vb!r}" for k, (va, vb) in c.job_differences.items())))
    click.echo("data/model:   " + ("same hashes" if not c.data_differences else "; ".join(c.data_differences)))
    click.echo("environment:  " + ("same" if not c.environment_differences else "; ".join(c.environment_differences)))
    for run_id, changes in c.drift.items():
        click.echo(f"drift in {run_id}: " + "; ".join(changes))
    for run_id, items in c.interruptions.items():
        if items:
            click.echo(f"interruptions of {run_id}: " + ", ".join(f"{k}@{s}" + (f" ({r})" if r else "")
                                                                 for k, s, r in items))
    shown = c.losses if len(c.losses) <= limit else c.losses[: limit // 2] + [None] + c.losses[-limit // 2:]
    click.echo(f"{'step':>6}  {'loss A':>12}  {'loss B':>12}  {'|A-B|':>10}")
    for row in shown:
        if row is None:
            click.echo(f"{'...':>6}")
            continue
        step, la, lb = row
        diff = ("0" if la == lb else f"{abs(la - lb):.3g}") if la is not None and lb is not None else "-"
        fmt = lambda v: f"{v:.6f}" if v is not None else "-"  # noqa: E731
        click.echo(f"{step:>6}  {fmt(la):>12}  {fmt(lb):>12}  {diff:>10}")
    difference = loss_difference_text(c)
    if difference is not None:
        click.echo(f"per-step losses: {difference}")
    for run_id, evals in c.evals.items():
        if evals:
            click.echo(f"eval {run_id}: " + ", ".join(f"{s}:{v:.4f}" for s, v in evals))
    if any(c.preference.values()):
        names = sorted({n for series in c.preference.values() for n in series})
        kind = "GRPO metrics" if "reward" in names else "preference metrics"
        click.echo(f"{kind} (" + ", ".join(names) + "): "
                   + ("differ in " + ", ".join(c.preference_differences) if c.preference_differences
                      else "bitwise equal at every shared step"))
    _print_harness(c)
    if c.weights_equal is not None:
        click.echo("final trainable weights: " + ("bitwise equal" if c.weights_equal else
                                                   f"largest absolute difference {c.max_weight_diff}"))
    click.echo(f"verdict: {c.verdict}")


def _print_harness(c) -> None:
    """`lodger eval` scores of both runs side by side (metric ± standard error)."""
    from ..reporting.compare import harness_table
    from ..evaluation.harness import metric_text

    having = [run_id for run_id in (c.a, c.b) if c.harness.get(run_id)]
    if not having:
        return
    if len(having) == 1:
        missing = c.b if having == [c.a] else c.a
        click.echo(f"lm-eval scores: only {having[0]} has them; `lodger eval {missing}` scores the other")
        return
    columns, rows, notes = harness_table(c)
    click.echo("lm-eval scores (value ± standard error):")
    click.echo(f"  {'task':<26} {'metric':<10} " + " ".join(f"{name:>22}" for name in columns))
    for task, metric, values in rows:
        click.echo(f"  {task:<26} {metric:<10} " + " ".join(f"{metric_text(v):>22}" for v in values))
    for note in notes:
        click.echo(f"  note: {note}")


def _compare_federated(a: str, b: str, as_json: bool) -> None:
    from ..federated.evaluate import compare_federated, is_federated, job_id_of

    if is_federated(a) == is_federated(b):
        raise LodgerError(f"compare {a} {b}: give one federated job (federated:JOB_ID) and one centralized run")
    fed, central = (a, b) if is_federated(a) else (b, a)
    c = compare_federated(job_id_of(fed), central)
    if as_json:
        click.echo(json.dumps(c.as_dict(), indent=1))
        return
    click.echo(f"federated = {fed} (each round's global adapter, evaluated here)\ncentralized = {c.central_run}")
    click.echo(f"eval set: the centralized run's, {c.examples} examples; gap = federated - centralized")
    click.echo(f"{'round':>5}  {'steps':>6}  {'clients':>7}  {'federated':>10}  {'central@step':>18}  {'gap':>9}")
    fmt = lambda v: f"{v:.4f}" if v is not None else "-"  # noqa: E731
    for r in c.rows:
        central = f"{fmt(r['central_eval_loss'])}@{r['central_step']}" if r["central_step"] is not None else "-"
        gap = f"{r['gap']:+.4f}" if r["gap"] is not None else "-"
        click.echo(f"{r['round']:>5}  {r['steps']:>6}  {r['clients']:>7}  {fmt(r['federated_eval_loss']):>10}  "
                   f"{central:>18}  {gap:>9}")


@click.command()
@click.argument("run_id", metavar="RUN")
@click.argument("other", metavar="OTHER")
@click.option("--tolerance", type=float, default=1e-5, show_default=True,
              help="Largest loss and weight difference still called equal (when not bitwise).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write a PNG: both loss curves with interruptions and resumes marked, the eval losses, "
                   "and the per-step loss difference when the runs are not bitwise equal.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--against", "against", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A witness file (`lodger audit --witness`): records it no longer confirms make the verdict "
                   "'not trustworthy'.")
def compare(run_id: str, other: str, tolerance: float, plot_path: Path | None, as_json: bool,
            against: Path | None) -> None:
    """Compare RUN with OTHER (e.g. a resumed run with its baseline) and give a verdict.

    Shows differences in job, environment and data, per-step losses side by side, eval losses,
    whether the final trainable weights are bitwise equal, and each run's interruptions.
    Exits 0 when the runs are equal (bitwise or within tolerance), 1 otherwise.

    A federated job (`federated:JOB_ID`, on the coordinating machine) against a centralized run on
    the union of the data: each round's global adapter is evaluated on the centralized run's eval
    set and set against that run's eval loss at the same number of optimizer steps; prints the gap
    per round (exit 0: a report, not a verdict).

    \b
    Example: lodger compare my-job-resumed my-job-baseline --plot cmp.png
    Example: lodger compare federated:clinic-job clinic-union-20261129-101500-ab12
    """
    from ..reporting.compare import compare_runs, plot
    from ..federated.evaluate import is_federated

    if is_federated(run_id) or is_federated(other):
        _compare_federated(run_id, other, as_json)
        return

    c = compare_runs(run_id, other, tolerance, against)
    _print_comparison(c, as_json)
    if plot_path:
        plot(c, plot_path)
        if not as_json:
            click.echo(f"plot: {plot_path}")
    if not c.equal:
        raise SystemExit(1)


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option("--quiet", is_flag=True, help="Only errors and the verdict on the terminal.")
def reproduce(run_id: str, quiet: bool) -> None:
    """Run RUN's job again from scratch, from its record, and compare with the original.

    Refuses when a data file or the model no longer matches the hash recorded for RUN.

    Example: lodger reproduce my-job-20261129-101500-ab12
    """
    from ..home import run_dir
    from ..ledger import Ledger
    from ..lifecycle.prepare import JOB_FILE
    from ..lifecycle.run import Run
    from ..lifecycle import jobfile
    from ..model import resolve_source
    from ..hashing import hash_file

    with Ledger() as ledger:
        run = ledger.find_run(run_id)
        record = ledger.provenance(run["id"])
    if not record:
        raise RunStateError(f"run {run['id']} has no provenance record; it never started")
    original = record[0]
    job = jobfile.load_job(run_dir(run["id"]) / JOB_FILE)
    problems = []
    for part, path in (("train", job.data.train), ("eval", job.data.eval)):
        want = original["data"].get(part)
        if want is None or path is None:
            continue
        now = hash_file(path) if path.is_file() else "missing"
        if now != want["sha256"]:
            problems.append(f"[data] {part} = {path}: recorded sha256 {want['sha256']}, now {now}")
    model_now = resolve_source(job.model.source).sha256
    if model_now != original["model"]["sha256"]:
        problems.append(f"[model] source = {job.model.source}: recorded sha256 {original['model']['sha256']}, "
                        f"now {model_now}")
    if problems:
        raise LodgerError("cannot reproduce: inputs changed since the run:\n" + "\n".join(f"  - {p}" for p in problems)
                          + "\nrestore the original files, or start a new run with `lodger run`")
    threads = original["numerics"]["threads"]
    again = Run.create(run_dir(run["id"]) / JOB_FILE, threads, name=f"{run['name']}-repro", reproduces=run["id"])
    new_id = again.run_id
    click.echo(f"run {new_id} (reproducing {run['id']})")
    outcome = again.start(resuming=False, quiet=quiet)
    if not outcome.finished:
        click.echo(f"reproduction {outcome.status}; continue it with `lodger resume {new_id}`")
        raise SystemExit(1)
    from ..reporting.compare import compare_runs

    c = compare_runs(new_id, run["id"])
    click.echo(f"verdict: {c.verdict}")
    if not c.equal:
        raise SystemExit(1)


COMMANDS = [compare, reproduce]
