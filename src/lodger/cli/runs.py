"""Commands that read: ls, show, logs, audit. None of them imports torch."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from ..errors import LodgerError
from ..lifecycle.runview import live_status


def _human(value):
    """Numbers rounded for people (4 decimals at most); `--json` keeps them exact."""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 10_000 else (f"{value:.4f}".rstrip("0").rstrip(".") or "0")
    return value


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "-"


def refresh_remote(ledger, runs: list[dict], only_active: bool = False) -> tuple[list[dict], dict[str, str]]:
    """Remote runs synced from storage and, where not ended, checked with their cluster (2 s at most
    for all; a job that died without a word becomes crashed). Returns the runs and, for those whose
    cluster did not answer, its address. A purely local ledger imports nothing and asks nothing."""
    if not any(r.get("target") for r in runs):
        return runs, {}
    from ..remote.live import ACTIVE, refresh

    wanted = [r for r in runs if r.get("target") and (r["status"] in ACTIVE or not only_active)]
    if not wanted:
        return runs, {}
    live = refresh(ledger, wanted)
    for warning in live.warnings:
        click.echo(f"warning: {warning}", err=True)
    fresh = {r["id"]: r for r in live.runs}
    return [fresh.get(r["id"], r) for r in runs], live.stale


def output_width() -> int | None:
    """The terminal's width ($COLUMNS first); None when printing into a pipe or a file (no limit)."""
    import os
    import shutil

    if os.environ.get("COLUMNS", "").isdigit() or sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


@click.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (exact numbers).")
def ls(as_json: bool) -> None:
    """List runs: id, status, step (and the last checkpoint's), loss, model, method, started.

    Run ids are never cut: in a narrow terminal the least useful columns go first. Every
    command takes a run's full id or any unique start of it.

    Example: lodger ls
    """
    from ..home import run_dir
    from ..ledger import Ledger
    from ..lifecycle.runview import loss_text, progress, step_text, table

    with Ledger() as ledger:
        runs, stale = refresh_remote(ledger, ledger.runs(), only_active=True)
    for run in runs:
        run["status"] = live_status(run) + ("?" if run["id"] in stale else "")  # "?": cluster unreachable
        run["progress"] = progress(run, run_dir(run["id"]))
    if as_json:
        keys = ("id", "status", "model", "method", "total_steps", "created")
        click.echo(json.dumps([{**{k: r[k] for k in keys}, "step": r["progress"]["step"],
                                "checkpoint_step": r["progress"]["checkpoint_step"], "loss": r["progress"]["loss"]}
                               for r in runs], indent=1))
        return
    if not runs:
        click.echo("no runs yet; start one with `lodger run JOB`")
        return
    rows = [[r["id"], r["status"], step_text(r["progress"]), loss_text(r["progress"]["loss"]),
             Path(r["model"]).name, r["method"], _when(r["created"])] for r in runs]
    header = ["run", "status", "step", "loss", "model", "method", "started"]
    for line in table(rows, header, output_width()):
        click.echo(line)


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--against", "against", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A witness file (`lodger audit --witness`): records it no longer confirms are marked UNVERIFIED.")
def show(run_id: str, as_json: bool, against: Path | None) -> None:
    """Status, progress, last good checkpoint, latest metrics, provenance and events of RUN.

    Rows the hash chain does not confirm are named first, in a WARNING; with --against a witness
    file, so are the records after the newest witnessed head still in the chain (a forger who
    rewrote the chain, or an older copy of ledger.db put back), and each such event is marked.

    Example: lodger show my-job-20261129-101500-ab12 --against ~/backup/lodger-heads.jsonl
    """
    from ..home import run_dir
    from ..ledger import Ledger
    from ..ledger.witness import unconfirmed

    with Ledger() as ledger:
        run = ledger.find_run(run_id)
        (run,), stale = refresh_remote(ledger, [run])
        events = ledger.events(run["id"])
        provenance = ledger.provenance(run["id"])
        train = ledger.metrics(run["id"], "train")
        evals = ledger.metrics(run["id"], "eval")
        untrusted = [f"{p.where()}: {p.problem}" for p in ledger.run_problems([run["id"]])]
        through, witness = unconfirmed(ledger, against, events) if against else (None, [])
    untrusted += witness
    for e in events:  # a record the witness cannot vouch for is not shown as fact
        e["verified"] = through is None or e["seq"] <= through
    run["status"] = live_status(run)
    folder = run_dir(run["id"])
    checkpoints = sorted(p.name for p in (folder / "checkpoints").glob("step-*")) if folder.exists() else []
    from ..lifecycle.runview import loss_text, progress

    now = progress(run, folder)
    info = {"run": run, "progress": now, "folder": str(folder), "checkpoints": checkpoints,
            "cluster_unreachable": stale.get(run["id"]),
            "last_train": train[-1] if train else None, "last_eval": evals[-1] if evals else None,
            "segments": len(provenance), "events": events, "chain_problems": untrusted}
    if as_json:
        info["provenance"] = provenance
        click.echo(json.dumps(info, indent=1, default=str))
        return
    for problem in untrusted:  # say it first: what follows comes from rows the chain does not confirm
        click.echo(f"WARNING   {problem}; run `lodger audit`" + (f" --against {against}" if against else ""), err=True)
    as_of = f", as last synced: cluster at {stale[run['id']]} unreachable" if run["id"] in stale else ""
    click.echo(f"run       {run['id']}  ({run['status']}{as_of})")
    newest = f"; newest checkpoint at step {now['checkpoint_step']}" if now["checkpoint_step"] != now["step"] else ""
    doubt = "  UNVERIFIED (see the WARNING)" if any(not e["verified"] for e in events) else ""
    click.echo(f"progress  step {now['step']}/{run['total_steps']}  loss {loss_text(now['loss'])}{newest}{doubt}")
    click.echo(f"model     {run['model']}  method {run['method']}")
    if run.get("target"):
        click.echo(f"remote    target {run['target']}  Ray submission {run['remote_job_id']}")
    click.echo(f"folder    {folder}")
    click.echo(f"last good checkpoint  {checkpoints[-1] if checkpoints else '-'}")
    _print_evals(now, info)
    if provenance:
        p = provenance[-1]
        code = p.get("code", {})
        click.echo(f"provenance  segments {len(provenance)}; lodger {p['lodger_version']}; python "
                   f"{p['python']['version']}; torch {p['packages'].get('torch')}; threads "
                   f"{p['numerics']['threads']}; host {p['host']}; git {code.get('commit', '-')}"
                   f"{' (dirty)' if code.get('dirty') else ''}")
        click.echo(f"            model sha256 {p['model']['sha256'][:16]}  train sha256 "
                   f"{p['data']['train']['sha256'][:16]}")
        quantised = p["model"].get("quantisation")
        if quantised:  # [method] base_bits: the base as it was trained against
            from ..quant import describe

            click.echo(f"            base {describe(quantised['bits'])} {quantised.get('version')}, quantised "
                       f"sha256 {quantised['sha256'][:16]}")
    _print_memory(events)
    _print_events(events)


def _print_memory(events: list[dict]) -> None:
    """The memory estimate beside the measured peak, and the checkpoint interval's reasoning."""
    created = next((e["data"] for e in events if e["kind"] == "created"), {})
    estimate = created.get("memory_estimate")
    # A GPU estimate is of GPU memory: compare it with the GPU's peak, not the process's resident set.
    measure = "peak_gpu_bytes" if estimate and estimate.get("device") == "cuda" else "peak_rss_bytes"
    peak = max((e["data"].get("compute", {}).get(measure) or 0 for e in events if "compute" in e["data"]),
               default=0)
    if estimate:
        measured = f", measured peak {peak / 2**30:.2f} GiB (ratio {peak / estimate['total_bytes']:.2f})" if peak else ""
        click.echo(f"memory    estimated {estimate['total_bytes'] / 2**30:.2f} GiB on {estimate['device']} "
                   f"(largest: {estimate['largest']}){measured}{' [forced past pre-flight]' if estimate['forced'] else ''}")
    rate = next((e["data"] for e in reversed(events) if e["kind"] == "matmul_rate"), None)
    if rate:  # what the step lines' MFU divides by
        from ..lifecycle.runview import rate_text

        click.echo(f"mfu peak  {rate_text(rate)}")
    interval = next((e["data"] for e in reversed(events) if e["kind"] == "checkpoint_interval"), None)
    if interval:
        from ..ckpt_interval import describe_event

        click.echo(f"interval  {describe_event(interval)}")


def _print_events(events: list[dict]) -> None:
    click.echo("events:")
    for e in events:
        data = ", ".join(f"{k}={_human(v)}" for k, v in e["data"].items()
                         if k not in ("compute", "memory_estimate", "measured"))
        if e["kind"] == "harness_eval":  # a whole score sheet: one line of it
            from .evaluate import summary

            data = summary(e["data"])
        mark = "" if e.get("verified", True) else "UNVERIFIED "
        click.echo(f"  {mark}{_when(e['time'])}  {e['kind']:<18} {data}")


def _print_evals(now: dict, info: dict) -> None:
    """The last eval's loss and, for a preference run, its metrics at the last step and eval."""
    from ..lifecycle.runview import loss_text

    if now["eval_step"] is not None or info["last_eval"]:
        step, loss = (now["eval_step"], now["eval_loss"]) if now["eval_step"] is not None else \
            (info["last_eval"]["step"], info["last_eval"]["eval_loss"])
        click.echo(f"last eval step {step}: eval_loss {loss_text(loss)}")
    for label, record, prefix in (("preference", info["last_train"], ""), ("  at eval", info["last_eval"], "eval_")):
        text = preference_text(record, prefix)
        if text:
            click.echo(f"{label}  step {record['step']}: {text}")
    for label, record, prefix in (("rewards", info["last_train"], ""), ("  at eval", info["last_eval"], "eval_")):
        text = grpo_text(record, prefix)
        if text:
            click.echo(f"{label}   step {record['step']}: {text}")
    _print_samples(info["last_eval"])


def grpo_text(record: dict | None, prefix: str = "") -> str:
    """A GRPO run's metric line in words (train/grpo.py's fields), '' for other objectives."""
    if not record or record.get(prefix + "reward") is None or f"{prefix}reward_accuracy" in record:
        return ""
    get = record.get
    parts = [f"mean {get(prefix + 'reward'):.4f}" + (f" (std {get(prefix + 'reward_std'):.4f})"
                                                     if get(prefix + "reward_std") is not None else "")]
    for key in sorted(record):
        name = key[len(prefix) + len("reward_"):]
        if key.startswith(prefix + "reward_") and not key.endswith("_std") and isinstance(record[key], (int, float)):
            parts.append(f"{name} {record[key]:.4f}")
    for key, name, form in (("frac_reward_zero_std", "groups without signal", "{:.0%}"),
                            ("completion_length", "completion length", "{:.1f}"), ("kl", "KL", "{:.4f}"),
                            ("clip_ratio", "clipped", "{:.1%}")):
        if get(prefix + key) is not None:
            parts.append(f"{name} " + form.format(get(prefix + key)))
    return ", ".join(parts)


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters (an escape sequence a completion or a data
    line could carry) written as \\xNN, newlines and tabs kept."""
    return "".join(ch if ch in "\n\t" or (ch.isprintable() and ord(ch) >= 32) else f"\\x{ord(ch):02x}" for ch in text)


def _print_samples(record: dict | None) -> None:
    """The newest eval's kept prompts with their completions and rewards (GRPO), escaped for the terminal."""
    samples = (record or {}).get("eval_samples") or []
    if not samples:
        return
    click.echo(f"samples   eval at step {record['step']} (greedy):")
    for sample in samples:
        rewards = ", ".join(f"{k} {'-' if v is None else f'{v:.3g}'}" for k, v in (sample.get("rewards") or {}).items())
        total = sample.get('reward')
        click.echo(f"  line {sample.get('line')}: reward {'-' if total is None else f'{total:.4g}'} ({rewards})")
        for key in ("prompt", "completion"):
            text = printable(str(sample.get(key, ""))).replace("\n", "\n      ")
            click.echo(f"    {key}: {text}")


def preference_text(record: dict | None, prefix: str = "") -> str:
    """A preference run's metric line in words (objective.py's fields), '' for SFT."""
    if not record or f"{prefix}reward_accuracy" not in record:
        return ""
    get = lambda key: record.get(prefix + key)  # noqa: E731
    parts = []
    if get("reward_margin") is not None:
        parts.append(f"reward margin {get('reward_margin'):+.4f}")
    parts.append(f"accuracy {get('reward_accuracy'):.0%}")
    if get("rewards_chosen") is not None or get("rewards_rejected") is not None:
        shown = lambda v: "-" if v is None else f"{v:+.4f}"  # noqa: E731
        parts.append(f"rewards chosen {shown(get('rewards_chosen'))} / rejected {shown(get('rewards_rejected'))}")
    for key, name in (("kl", "KL"), ("nll", "NLL"), ("log_odds_ratio", "log odds ratio")):
        if get(key) is not None:
            parts.append(f"{name} {get(key):.4f}")
    return ", ".join(parts)


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines while the run is alive.")
@click.option("--ray", "from_ray", is_flag=True, help="A remote run: print Ray's log of its current job instead.")
def logs(run_id: str, follow: bool, from_ray: bool) -> None:
    """Print RUN's log (log.txt); with -f, follow it like `tail -f`.

    A remote run's log is read from the target's storage; `--ray` asks Ray for the job's own
    output (the entrypoint's stdout and stderr, useful when the run never started).

    Example: lodger logs my-job-20261129-101500-ab12 -f
    """
    from ..remote.executors import executor_for
    from ..ledger import Ledger
    from ..owner.runlock import is_locked

    with Ledger() as ledger:
        run = ledger.find_run(run_id)
    executor = executor_for(run)
    if from_ray:
        sys.stdout.write(executor.engine_log(run))
        return
    folder = executor.folder(run)  # a remote run's live log, straight from storage
    path = folder / "log.txt"
    if not path.exists() and not follow:
        raise LodgerError(f"run {run['id']} has no log yet")
    position = 0
    while True:
        if path.exists():
            with open(path, encoding="utf-8", errors="replace") as fh:
                fh.seek(position)
                chunk = fh.read()
                position = fh.tell()
            if chunk:
                sys.stdout.write(chunk)
                sys.stdout.flush()
        if not follow or not is_locked(folder):
            if follow and path.exists() and path.stat().st_size > position:
                continue  # drain what was written before the run stopped
            return
        time.sleep(0.5)


@click.command()
@click.option("--witness", "witness", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="After a clean audit, append the chain's head (seq, hash, time) to this file; keep it "
                   "where an editor of ledger.db does not reach.")
@click.option("--against", "against", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Prove every head in this witness file is still in today's chain with the same hash.")
@click.option("--sign-key", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Ed25519 private key (PEM) to sign the head written by --witness.")
@click.option("--public-key", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Ed25519 public key (PEM): with --against, every witness line must carry its signature.")
def audit(witness: Path | None, against: Path | None, sign_key: Path | None, public_key: Path | None) -> None:
    """Verify the hash chain and every table against it; exit 1 on any disagreement.

    Checks that no event was edited, deleted or inserted, and recomputes runs, metrics,
    provenance, datasets, the queue and targets.toml from the chain, naming each row that differs
    (table, run, step). A forger who recomputes every hash is caught only by a head witnessed
    earlier outside ledger.db: see docs/security.md.

    \b
    Example: lodger audit --witness ~/backup/lodger-heads.jsonl
             lodger audit --against ~/backup/lodger-heads.jsonl
    """
    from ..ledger import Ledger
    from ..ledger.witness import append_witness, check_against
    from ..remote.targets import load_targets

    if sign_key and not witness:
        raise LodgerError("--sign-key signs the head --witness writes; add --witness FILE")
    if public_key and not against:
        raise LodgerError("--public-key checks the signatures of --against FILE; add --against FILE")
    try:
        targets = {name: t.model_dump(mode="json") for name, t in load_targets().items()}
    except LodgerError as exc:  # the ledger is still worth auditing; the file is reported, not compared
        click.echo(f"warning: targets not compared with the chain: {exc}", err=True)
        targets = None
    with Ledger() as ledger:
        count, problems = ledger.audit()
        records = ledger.audit_records(targets)
        witnessed, against_problems = check_against(ledger, against, public_key) if against else (0, [])
        head = ledger.head()
    for problem in problems:
        click.echo(f"row {problem.seq}: {problem.problem}", err=True)
    for problem in records:
        event = f" (event row {problem.seq})" if problem.seq else ""
        click.echo(f"{problem.where()}: {problem.problem}{event}", err=True)
    for problem in against_problems:
        click.echo(problem, err=True)
    total = len(problems) + len(records) + len(against_problems)
    if total:
        found = [f"{n} {what}" for n, what in ((len(problems), f"problem(s) in {count} events"),
                                               (len(records), "table row(s) that disagree with the chain"),
                                               (len(against_problems), "witnessed head(s) not in today's chain"))
                 if n]
        raise LodgerError(("ledger chain broken: " if problems or against_problems else "ledger tables edited: ")
                          + ", ".join(found))
    click.echo(f"ledger intact: {count} events, hash chain verified; every table agrees with the chain")
    if against:
        click.echo(f"all {witnessed} witnessed head(s) in {against} are in today's chain")
    if witness:
        line = append_witness(witness, head, sign_key)
        click.echo(f"witnessed head row {line['seq']} ({line['hash'][:16]}...) in {witness}"
                   + (" (signed)" if sign_key else ""))


COMMANDS = [ls, show, logs, audit]
