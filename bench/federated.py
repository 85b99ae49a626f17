"""Federated vs centralized: two clients for a fixed number of rounds on Flower's deployment runtime
(a real SuperLink and two real SuperNodes on 127.0.0.1), against one `lodger run` on the union of
their data with the same total optimizer steps (2 clients x rounds x local steps).

Prints, as ratios:

    federated: eval-loss ratio federated/centralized R (...)
    federated: wall-time per round ratio federated/centralized W (...); federation overhead per round O s

Eval loss: both final adapters on the same held-out chats, summed token loss over target tokens,
computed here in one process with transformers + peft (the adapters as peft loads them). Wall time:
the federated run from `flwr run` to the server's `federated_finished` event, over the rounds;
the centralized run's wall time (`lodger run` as a child process) over the same number of rounds'
worth of steps. The overhead per round is the federated round's wall time minus the slowest
client's training time in that round (each client's round run's own wall seconds), averaged.
It also prints where a round's seconds go: the mean of each stage the clients record with every
round (`seconds` of `federated_client_round`, federated/client.py STAGES), and the rest of the
round outside the ClientApp process (Flower's polling and transport, the server's side).

Default size is small (the tiny random Llama of the tests, 3 rounds of 2 local steps); `--model`
takes a model folder or alias (e.g. smollm2-135m-instruct) for real numbers. State goes under
$LODGER_BENCH_HOME/federated (default /tmp/lodger-bench-home/federated), deleted at start.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

CLIENTS = ("alice", "bob")


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ, LODGER_HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def _lodger(args: list, home: Path) -> subprocess.CompletedProcess:
    lodger = Path(sys.executable).with_name("lodger")
    done = subprocess.run([str(lodger), *map(str, args)], env=_env(home), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"lodger {' '.join(map(str, args))} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done


def _job(path: Path, model: str, train: Path, *, steps: int, extra: str = "", args) -> Path:
    path.write_text(f'name = "fedbench"\n[model]\nsource = {json.dumps(model)}\n'
                    f'[method]\nkind = "lora"\nrank = 4\nalpha = 8.0\ndropout = 0.0\n'
                    f'[data]\ntrain = {json.dumps(str(train))}\nmax_length = {args.max_length}\neval_fraction = 0.0\n'
                    f'[training]\nsteps = {steps}\nbatch_size = {args.batch}\ngrad_accum = 1\nlearning_rate = 5e-3\n'
                    f'seed = 0\nthreads = 1\n[checkpoints]\nevery_steps = {steps}\nkeep_last = 2\n'
                    f'[policy]\nenabled = false\n{extra}')
    return path


def _events(home: Path, kind: str) -> list[dict]:
    from lodger.ledger import Ledger

    with Ledger(home / "ledger.db") as ledger:
        return ledger.events_of_kinds((kind,))


def _wait(condition, timeout: float, what: str, process=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if process is not None and process.poll() is not None:
            raise SystemExit(f"a Flower process exited before {what}")
        time.sleep(0.5)  # polling an observed state, bounded by the deadline
    raise SystemExit(f"timed out waiting for {what}")


def eval_loss(model_folder: Path, adapter: Path, eval_file: Path, max_length: int) -> float:
    """Mean target-token loss of base model + adapter over the eval chats (lodger's tokenisation)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lodger.data.chats import collate, read_jsonl, tokenize
    from lodger.model import load_tokenizer, tokenizer_hash

    tokenizer = load_tokenizer(model_folder)
    data = tokenize(read_jsonl(eval_file), tokenizer, tokenizer_hash(model_folder), max_length)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_folder)), str(adapter)).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(data), 8):
            batch = collate(data, list(range(start, min(start + 8, len(data)))), tokenizer.pad_token_id or 0)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            labels = batch["labels"][:, 1:]
            losses = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                       labels.reshape(-1), ignore_index=-100, reduction="sum")
            total, count = total + float(losses), count + int((labels != -100).sum())
    return total / count


def federated(root: Path, model: str, shards: dict[str, Path], args) -> tuple[Path, float, list[float], dict]:
    """Run the federation; return (global adapter folder, wall seconds, per-round overhead seconds,
    where the seconds went: the mean per stage of a client's round and the rest of the round)."""
    from lodger.reporting.compare import total_compute
    from lodger.federated import processes

    placeholder = root / "placeholder.jsonl"
    placeholder.write_text('{"text": "unused"}\n')
    job = _job(root / "fed.toml", model, placeholder, steps=1, args=args,
               extra=f"[federated]\nrounds = {args.rounds}\nlocal_steps = {args.local_steps}\nmin_clients = 2\n")
    server_home = root / "home-server"
    server_home.mkdir(mode=0o700)
    homes = {}
    for name, shard in shards.items():
        homes[name] = root / f"home-{name}"
        homes[name].mkdir(mode=0o700)
        _lodger(["data", "add", shard, "--name", f"{name}-notes", "--license", "CC0-1.0", "--owner", name,
                 "--federate"], homes[name])
    port = processes.free_port()
    started = [processes.start_superlink(server_home, port, env={"LODGER_HOME": str(server_home)})]
    try:
        for name, home in homes.items():
            started.append(processes.start_supernode(home, f"127.0.0.1:{port}", {
                "lodger-home": str(home), "client-id": name, "dataset": f"{name}-notes", "job": str(job)}))
        t0 = time.time()
        processes.run_app(server_home, f"127.0.0.1:{port}",
                          {"job": str(job), "job-id": "fedbench", "lodger-home": str(server_home)})
        finished = _wait(lambda: _events(server_home, "federated_finished"), args.timeout, "the federated run",
                         started[0].process)
        wall = finished[0]["time"] - t0
    finally:
        for process in reversed(started):
            process.stop()
    rounds = sorted(_events(server_home, "federated_round"), key=lambda e: e["seq"])
    overheads, previous = [], t0
    from lodger.ledger import Ledger

    stages: dict[str, list[float]] = {}
    for event in rounds:
        slowest, slowest_process = 0.0, 0.0
        for home in homes.values():
            with Ledger(home / "ledger.db") as ledger:
                for e in ledger.events_of_kinds(("federated_client_round",)):
                    if e["data"].get("round") == event["data"]["round"] and e["run_id"]:
                        slowest = max(slowest, total_compute(ledger.events(e["run_id"]))["wall_seconds"])
                        seconds = e["data"].get("seconds") or {}
                        slowest_process = max(slowest_process, sum(seconds.values()))
                        for name, value in seconds.items():
                            stages.setdefault(name, []).append(value)
        overheads.append((event["time"] - previous) - slowest)
        stages.setdefault("outside_the_clientapp", []).append((event["time"] - previous) - slowest_process)
        previous = event["time"]
    breakdown = {name: sum(values) / len(values) for name, values in stages.items()}
    return server_home / "federated" / "fedbench" / "adapter", wall, overheads, breakdown


def centralized(root: Path, model: str, union: Path, args) -> tuple[Path, float]:
    home = root / "home-central"
    home.mkdir(mode=0o700)
    steps = len(CLIENTS) * args.rounds * args.local_steps
    job = _job(root / "central.toml", model, union, steps=steps, args=args)
    t0 = time.time()
    done = _lodger(["run", job, "--quiet"], home)
    wall = time.time() - t0
    run_id = done.stdout.splitlines()[0].split()[1]
    return home / "runs" / run_id / "adapter", wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder or alias (default: the tests' tiny random Llama)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=48)
    parser.add_argument("--examples", type=int, default=24, help="chats per client")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()

    from fixtures_lib import build_tiny_model, write_chat_jsonl

    root = Path(os.environ.get("LODGER_BENCH_HOME", "/tmp/lodger-bench-home")) / "federated"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    model = args.model or str(build_tiny_model(root / "model", seed=0))
    shards = {name: write_chat_jsonl(root / f"{name}.jsonl", args.examples, seed=10 + i)
              for i, name in enumerate(CLIENTS)}
    union = root / "union.jsonl"
    union.write_text("".join(p.read_text() for p in shards.values()))
    eval_file = write_chat_jsonl(root / "eval.jsonl", 16, seed=99)
    print(f"# load average {os.getloadavg()[0]:.2f}; {len(CLIENTS)} clients x {args.rounds} rounds x "
          f"{args.local_steps} local steps, batch {args.batch}; model {args.model or 'tiny random Llama'}")
    fed_adapter, fed_wall, overheads, breakdown = federated(root, model, shards, args)
    print(f"# federated: {fed_wall:.1f} s for {args.rounds} rounds")
    print("# a round's seconds (mean over clients and rounds; outside_the_clientapp: the round's wall time minus "
          "the slowest ClientApp process, i.e. Flower's process start-up before Python runs, its polling and "
          "transport, the server's aggregation and commit): " + ", ".join(f"{k} {v:.1f}" for k, v in breakdown.items()))
    central_adapter, central_wall = centralized(root, model, union, args)
    print(f"# centralized: {central_wall:.1f} s for {len(CLIENTS) * args.rounds * args.local_steps} steps")
    from lodger.model import model_folder, resolve_source

    folder = model_folder(resolve_source(model))
    fed_loss = eval_loss(folder, fed_adapter, eval_file, args.max_length)
    central_loss = eval_loss(folder, central_adapter, eval_file, args.max_length)
    per_round_fed, per_round_central = fed_wall / args.rounds, central_wall / args.rounds
    overhead = sum(overheads) / len(overheads) if overheads else float("nan")
    print(f"federated: eval-loss ratio federated/centralized {fed_loss / central_loss:.3f} "
          f"(federated {fed_loss:.4f}, centralized {central_loss:.4f}; same total steps)")
    print(f"federated: wall-time per round ratio federated/centralized {per_round_fed / per_round_central:.2f} "
          f"({per_round_fed:.1f} s vs {per_round_central:.1f} s per round's worth of steps); federation overhead "
          f"per round {overhead:.1f} s ({overhead / per_round_fed:.0%} of a federated round)")


if __name__ == "__main__":
    main()
