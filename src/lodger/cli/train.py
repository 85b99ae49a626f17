"""Commands that train: init, run, resume."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from typing import TYPE_CHECKING

from ..errors import JobFileError, RunStateError
from .crash import log_to_run

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..ledger import Ledger
    from ..lifecycle.prepare import Prepared
    from ..lifecycle.run import Run
    from ..reporting.report import Phase


@click.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite FILE if it exists.")
@click.option("--remote", is_flag=True, help="Add a commented [remote] section (the limits `lodger submit` needs).")
@click.option("--objective", type=click.Choice(["sft", "dpo", "orpo", "kto", "grpo"]), default="sft",
              show_default=True,
              help="What the job learns from: supervised chats, preference pairs (dpo, orpo), labelled "
                   "completions (kto; docs/preference.md), or rewards a program computes (grpo; docs/grpo.md).")
def init(file: Path, force: bool, remote: bool, objective: str) -> None:
    """Write a commented job file that runs as written.

    Beside it go the bundled demo data (train.jsonl and eval.jsonl; with --objective, preference
    pairs or, for kto, the pairs as good and bad completions; for grpo, arithmetic prompts with
    their answers and verifier.py, the reward function that checks them) unless files of those
    names are already there. Edit the file, then train with `lodger run FILE`.

    \b
    Example: lodger init my-job.toml
             lodger init my-job.toml --remote
             lodger init dpo-job.toml --objective dpo
             lodger init grpo-job.toml --objective grpo
    """
    from ..lifecycle.jobfile import example_job

    if file.exists() and not force:
        raise JobFileError(f"{file} already exists; pick another name or pass --force to overwrite it")
    folder = file.parent
    folder.mkdir(parents=True, exist_ok=True)
    names = _demo_data(folder, objective)
    file.write_text(example_job(*names, remote=remote, objective=objective))
    click.echo(f"wrote {file} (data: {folder / names[0]}, {folder / names[1]})")
    click.echo(f"next: lodger run {file}")


def _demo_data(folder: Path, objective: str) -> tuple[str, str]:
    """Copy the bundled data for ``objective`` beside the job (never over a file of the same name)."""
    from importlib import resources

    demo = resources.files("lodger") / "demo"
    if objective == "grpo":  # prompts with answers, and the verifier the job names as its reward
        for source, name in (("grpo.jsonl", "grpo.jsonl"), ("grpo_eval.jsonl", "grpo_eval.jsonl"),
                             ("verifier.py", "verifier.py")):
            if not (folder / name).exists():
                (folder / name).write_text((demo / source).read_text(encoding="utf-8"), encoding="utf-8")
        return "grpo.jsonl", "grpo_eval.jsonl"
    sources = {"sft": ("train.jsonl", "eval.jsonl")}.get(objective, ("preference.jsonl", "preference_eval.jsonl"))
    names = sources if objective != "kto" else ("kto.jsonl", "kto_eval.jsonl")
    for source, name in zip(sources, names):
        if (folder / name).exists():
            continue
        text = (demo / source).read_text(encoding="utf-8")
        if objective == "kto":  # each pair as two labelled lines (TRL's unpair_preference_dataset)
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            text = "".join(json.dumps({"prompt": r["prompt"], "completion": r[key], "label": key == "chosen"}) + "\n"
                           for r in rows for key in ("chosen", "rejected"))
        (folder / name).write_text(text, encoding="utf-8")
    return names


@click.command()
@click.argument("job", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--threads", type=click.IntRange(1, 1024), help="Override [training] threads.")
@click.option("--quiet", is_flag=True, help="Print only the run id and errors (log.txt still gets everything).")
@click.option("--detach", is_flag=True, help="Train in the background (survives the terminal); return once it "
                                             "has started and say how to follow it.")
@click.option("--force", is_flag=True, help="Run even if the memory estimate says it will not fit (recorded).")
def run(job: Path, threads: int | None, quiet: bool, detach: bool, force: bool) -> None:
    """Train the job in JOB (a TOML file), in this terminal or in the background (--detach).

    Everything is validated before anything is written. At a terminal a live line shows step,
    loss, elapsed time, ETA and target tokens/s; elsewhere plain step lines are printed. The
    first line of output is always `run RUN-ID`. Ctrl-C or SIGTERM commits a checkpoint at the
    next step and exits 0; a second Ctrl-C quits at once. Continue with `lodger resume RUN`.

    \b
    Example: lodger run my-job.toml
             lodger run my-job.toml --detach
    """
    from ..lifecycle.jobfile import load_job
    from ..lifecycle.run import Run
    from ..reporting.report import Phase

    started = time.monotonic()
    announced = announce_first_use(load_job(job), quiet)
    with Phase("checking the job and its data, tokenising, estimating memory", err=True, quiet=quiet):
        new = Run.create(job, threads, managed=detach, force=force)
    log_to_run(new.run_id)
    if announced:
        first_use_done(started)
    click.echo(f"run {new.run_id}")  # the command's result, under --quiet too: scripts read the id here
    if not quiet:
        _note_unregistered(new.prepared)
    if detach:
        _detach(new, fresh=True, quiet=quiet)
        return
    with _starting(new.prepared, quiet):
        new.start(resuming=False, quiet=quiet)


def _starting(prepared: Prepared, quiet: bool, what: str = "loading the model and starting the run") -> Phase:
    """A phase that lasts until the run's own lines start (report.hand_over); one process only:
    with several, the run's lines come from another process."""
    from ..reporting.report import Phase

    return Phase(what, quiet=quiet or prepared.job.training.world_size > 1)


def announce_first_use(job: JobConfig, quiet: bool) -> bool:
    """Say what is happening before a model's first use takes a while (converting a GGUF file);
    True when it was said, so the caller can say when it is done."""
    from ..model import preparation_notice, resolve_source

    notice = preparation_notice(resolve_source(job.model.source))
    if notice and not quiet:
        click.echo(notice, err=True)
    return bool(notice) and not quiet


def first_use_done(started: float) -> None:
    import time

    click.echo(f"model prepared in {time.monotonic() - started:.0f} s; later runs skip this step", err=True)


def _note_unregistered(prepared: Prepared) -> None:
    """One line for data files that are not registered datasets (allowed here; kept in provenance)."""
    files = [f"[data] {use.role} = {str(use.file.path)!r}" for use in prepared.job.data_uses() if use.dataset is None]
    if files:
        verb = "is not a registered dataset" if len(files) == 1 else "are not registered datasets"
        click.echo(f"warning: {' and '.join(files)} {verb}; allowed on this machine and recorded in the run's "
                   "provenance; `lodger data add FILE --name N --license L --owner O` registers one "
                   "(docs/boundary.md)", err=True)


def _detach(run: Run, fresh: bool, extra: list[str] | None = None, quiet: bool = False) -> None:
    from ..home import run_dir

    pid = run.detach(fresh=fresh, extra=extra)
    run_id = run.run_id
    if quiet:
        return
    click.echo(f"training in the background (pid {pid}); it loads the model, then trains\n"
               f"  follow it:  lodger logs {run_id} -f\n"
               f"  see it:     lodger status   (or lodger show {run_id})\n"
               f"  log file:   {run_dir(run_id) / 'log.txt'}")


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option("--threads", type=click.IntRange(1, 1024),
              help="Resume at another thread count (works, but is recorded as drift: no longer bitwise comparable).")
@click.option("--world-size", type=click.IntRange(1, 1024),
              help="Override [training] world_size (processes); refused when the checkpoint was written by "
                   "another number of processes.")
@click.option("--quiet", is_flag=True, help="Print only errors (log.txt still gets everything).")
@click.option("--detach", is_flag=True, help="Continue in the background; return once it has started.")
@click.option("--force", is_flag=True, help="Resume even if the memory estimate says it will not fit (recorded; "
                                           "a run started with --force keeps it).")
def resume(run_id: str, threads: int | None, world_size: int | None, quiet: bool, detach: bool,
           force: bool) -> None:
    """Continue RUN: a held run where it stands, a stopped one from its newest good checkpoint.

    A stopped run passes the same memory pre-flight as `lodger run` before anything changes.
    Damaged checkpoints are reported, moved aside and skipped. On the same machine, threads and
    library versions the result is bitwise identical to an uninterrupted run; otherwise lodger
    warns and records the drift. A data-parallel run resumes only with the number of processes
    that wrote its checkpoint.

    Example: lodger resume my-job-20261129-101500-ab12 --detach
    """
    from ..owner.control import clear_request
    from ..remote.executors import executor_for
    from ..home import run_dir
    from ..lifecycle.jobfile import load_job
    from ..ledger import Ledger
    from ..lifecycle.prepare import JOB_FILE
    from ..lifecycle.run import Run

    with Ledger() as ledger:
        run = ledger.find_run(run_id)
        answer = executor_for(run).resume(ledger, run)  # continued where it lives: a remote run, a held one
        if answer is not None:
            click.echo(f"run {run['id']} {answer}")
            return
        folder = run_dir(run["id"])  # no process trains it: it starts here again
        if (folder / JOB_FILE).is_file():  # a missing one is refused, with its own message, just below
            announce_first_use(load_job(folder / JOB_FILE), quiet)
        again = Run(run["id"])
        prepared = _prepare_resume(ledger, again, threads, world_size, force)
        for requester in ("user", "agent"):  # the owner asked for it: earlier pause requests are void
            clear_request(folder, requester)
        if detach:
            ledger.update_run(run["id"], managed=1)
    if detach:
        click.echo(f"run {run['id']}")
        extra = ([f"--threads={threads}"] if threads else []) + ([f"--world-size={world_size}"] if world_size else [])
        _detach(again, fresh=run["status"] == "created" and not (folder / "checkpoints").exists(), extra=extra,
                quiet=quiet)
        return
    log_to_run(run["id"])
    # Alone, this process takes the run before it loads the model and restores the checkpoint: a
    # pause sent meanwhile is answered as soon as the model is loaded, not refused as "not training".
    if prepared.job.training.world_size == 1:
        again.take()
    with _starting(prepared, quiet, "loading the model"):
        again.start(resuming=True, quiet=quiet)


def _prepare_resume(ledger: Ledger, again: Run, threads: int | None, world_size: int | None,
                    force: bool) -> Prepared:
    """Validate the run's job, data and model again and run `lodger run`'s memory pre-flight, before
    anything is written (the data, the machine or config.toml's [limits] may have changed since)."""
    from ..distributed import checkpoint_world_size, refuse_other_world_size
    from ..home import run_dir
    from ..lifecycle.prepare import preflight

    run_id = again.run_id
    prepared = again.reopen(threads, world_size)
    refuse_other_world_size(run_id, checkpoint_world_size(run_dir(run_id)), prepared.job.training.world_size)
    _refuse_changed_inputs(ledger, run_id, prepared)
    # The owner's --force at `lodger run` holds for the run's resumes; it is recorded again below.
    forced_at_start = any(e["kind"] == "created" and (e["data"].get("memory_estimate") or {}).get("forced")
                          for e in ledger.events(run_id))
    memory = preflight(prepared, force or forced_at_start)
    if memory["forced"]:
        ledger.event(run_id, "preflight_forced", memory_estimate=memory)
    return prepared


def _refuse_changed_inputs(ledger: Ledger, run_id: str, prepared: Prepared) -> None:
    """Data or model that differ from what the run recorded are refused now, with the file named,
    not after the model loaded (the checkpoint's own record is checked again when it is restored)."""
    segments = ledger.provenance(run_id)
    if not segments:
        return
    recorded = segments[-1]
    now = {"train": prepared.train_file, "eval": prepared.eval_file}
    for role, file in now.items():
        was = (recorded.get("data", {}).get(role) or {}).get("sha256")
        if was and was != (file.sha256 if file else None):
            raise RunStateError(f"run {run_id}: [data] {role} {file.path if file else '(none)'} changed since the run "
                                f"trained on it (sha256 {was}, now {file.sha256 if file else None}); restore the "
                                "original file, or start a new run with `lodger run`")
    was = recorded.get("model", {}).get("sha256")
    if was and was != prepared.source.sha256:
        raise RunStateError(f"run {run_id}: [model] source {prepared.source.spec} changed since the run trained on it "
                            f"(sha256 {was}, now {prepared.source.sha256}); restore the original model files, or "
                            "start a new run with `lodger run`")


COMMANDS = [init, run, resume]
