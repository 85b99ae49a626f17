"""Chat latency of `lodger serve` while a LoRA run trains: idle, yielding, not yielding.

The same fixed prompts (greedy, a fixed max_tokens, so every condition generates the same tokens)
are sent one at a time in three conditions, interleaved prompt by prompt (the order rotating each
round) so that a change in the machine's load touches all three alike:

- idle:     nothing computing but the server: the background run is held by the user (as
            `lodger pause --hold` does: asleep, no CPU; its memory stays allocated);
- yield:    `lodger serve` while a LoRA run of the benchmark job trains in the background; the
            server's inference lease holds the run for each request and its grace period
            (`[policy] inference_grace_seconds`);
- no-yield: a second server, `lodger serve --no-yield`, while the run trains on.

Before each request the run trains for ``--gap`` seconds (more than the grace period), so each
yield request finds it training: the worst case for yielding, since the server starts generating
at once and competes with the rest of the run's current micro-step. Both servers serve the base
model (`base`); the run's adapter would add the same small cost to each. Measured by the client
(the official `openai` package, streaming): time to the first content token (ttft) and to the end
of the answer (total).

    python bench/chat_latency.py            # SmolLM2-135M-Instruct, LoRA job as in bench/README.md
    python bench/chat_latency.py --tiny     # the tests' tiny random model (a smoke run, minutes)

State goes to $LODGER_BENCH_HOME (see common.py); the training run is stopped (SIGTERM: it commits a
checkpoint and exits) at the end. Lines starting with `#` are context; the others are the result.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis in one sentence.",
    "Give me three tips for sleeping better.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Name a famous painting by Vincent van Gogh.",
    "How do I boil an egg?",
    "What does a CPU do?",
    "Suggest a name for a pet turtle.",
]
GOAL_YIELD_RATIO = 1.25
TRAINING_STEPS = 1_000_000  # never finishes during the benchmark; stopped at the end


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0-100) of a small sample."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_setup() -> tuple[str, Path]:
    """The tests' tiny random Llama and toy chat data, built once in the bench home."""
    sys.path.insert(0, str(common.ROOT / "tests"))
    from fixtures_lib import build_tiny_model, write_chat_jsonl

    folder = common.bench_home() / "tiny-model"
    if not (folder / "model.safetensors").is_file():
        build_tiny_model(folder, seed=0)
    data = common.bench_home() / "tiny-chat-train.jsonl"
    if not data.is_file():
        write_chat_jsonl(data, 256, seed=0)
    return str(folder), data


def write_job(tiny: bool, grace: float) -> tuple[Path, str]:
    """The training job of the background run, and the model source the server uses."""
    folder = common.bench_home() / "chat-latency"
    if tiny:
        model, data = tiny_setup()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "tiny.toml"
        path.write_text(f"""name = "chat-latency-tiny"
[model]
source = "{model}"
[method]
kind = "lora"
rank = 4
alpha = 8.0
dropout = 0.0
[data]
train = "{data}"
eval_fraction = 0.0
max_length = 64
[training]
steps = {TRAINING_STEPS}
batch_size = 4
seed = {common.SEED}
threads = {common.THREADS}
log_every = 1000000
[checkpoints]
every_steps = 200
keep_last = 2
""")
    else:
        model = common.MODEL_ALIAS
        path = common.write_job(folder, TRAINING_STEPS, every_steps=200, name="chat-latency")
    with path.open("a") as fh:
        fh.write(f"[policy]\nyield_to_inference = true\ninference_grace_seconds = {grace}\n")
    return path, model


class Server:
    """`lodger serve` in a child process, on a free port of 127.0.0.1."""

    def __init__(self, model: str, *extra: str):
        self.port = free_port()
        log = common.bench_home() / f"chat-latency-serve-{self.port}.log"
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([common.lodger_bin(), "serve", "--model", model, "--port", str(self.port),
                                          *extra], stdout=out, stderr=subprocess.STDOUT, env=common.child_env())
        import httpx

        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"lodger serve exited ({self.proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise SystemExit("lodger serve did not answer within 600 s") from None
                time.sleep(0.2)

    def client(self):
        import openai

        # the token `lodger serve` made on first use in the bench home (or LODGER_API_TOKEN, which it then uses)
        token = os.environ.get("LODGER_API_TOKEN") or (common.bench_home() / "serve-token").read_text().strip()
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=token, max_retries=0, timeout=600)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the lease releases its holds on shutdown
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def ask(client, prompt: str, max_tokens: int, folder: Path | None = None) -> dict:
    """One streamed, greedy chat answer: ttft, total seconds, the text, content chunks; with ``folder``
    also how long after the request began the run said it was held (None: not before the answer ended)."""
    import threading

    from lodger.owner.control import run_state

    started = time.perf_counter()
    done, hold = threading.Event(), {}

    def watch() -> None:  # control/state.json, as often as it is worth reading
        while not done.is_set():
            state = run_state(folder)
            if state.get("state") == "held" and state.get("time", 0) >= wall_start:
                hold["after"] = time.perf_counter() - started
                return
            done.wait(0.005)

    wall_start = time.time()
    if folder is not None:
        threading.Thread(target=watch, daemon=True).start()
    first, pieces = None, []
    stream = client.chat.completions.create(model="base", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                if first is None:
                    first = time.perf_counter() - started
                pieces.append(choice.delta.content)
    total = time.perf_counter() - started
    done.set()
    return {"ttft": first if first is not None else total, "total": total, "text": "".join(pieces),
            "chunks": len(pieces), "held_after": hold.get("after")}


def summary(label: str, results: list[dict]) -> str:
    ttft = [r["ttft"] for r in results]
    total = [r["total"] for r in results]
    return (f"latency {label}: ttft p50 {percentile(ttft, 50):.2f} s p95 {percentile(ttft, 95):.2f} s, "
            f"total p50 {percentile(total, 50):.2f} s p95 {percentile(total, 95):.2f} s "
            f"({len(results)} requests)")


def start_training(job: Path) -> tuple[str, Path]:
    """`lodger run JOB --detach`; returns once the run has finished a first optimizer step."""
    result = common.run_child([common.lodger_bin(), "run", str(job), "--detach"]).check()
    run_id = next(line.split()[1] for line in result.stdout.splitlines() if line.startswith("run "))
    folder = common.bench_home() / "runs" / run_id
    deadline = time.monotonic() + 900
    while not any(json.loads(line).get("kind") == "train" for line in _lines(folder / "metrics.jsonl")):
        if time.monotonic() > deadline:
            raise SystemExit(f"run {run_id} made no step in 900 s; see {folder}/log.txt")
        time.sleep(0.2)
    return run_id, folder


def _lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().split("\n")[:-1] if line.strip()]
    except FileNotFoundError:
        return []


def stop_training(folder: Path) -> None:
    from lodger.owner.runlock import is_locked, lock_pid

    pid = lock_pid(folder)
    if pid is None or not is_locked(folder):
        return
    os.kill(pid, signal.SIGTERM)  # commits a checkpoint at the next step and exits
    deadline = time.monotonic() + 300
    while is_locked(folder) and time.monotonic() < deadline:
        time.sleep(0.2)
    if is_locked(folder):
        os.kill(pid, signal.SIGKILL)


def holds_by_serve(run_id: str, since: float) -> tuple[int, float]:
    """(held events by `serve`, seconds held in all) since ``since``."""
    from lodger.ledger import Ledger

    with Ledger() as ledger:
        events = [e for e in ledger.events(run_id) if e["time"] >= since]
    held = [e for e in events if e["kind"] == "held" and e["data"].get("by") == "serve"]
    seconds = sum(e["data"].get("held_seconds", 0.0) for e in events
                  if e["kind"] == "continued" and e["data"].get("by") == "serve")
    return len(held), seconds


def steps_between(folder: Path, since: float, until: float) -> int:
    """Optimizer steps the run finished between two wall-clock times (from metrics.jsonl)."""
    return sum(1 for line in _lines(folder / "metrics.jsonl")
               if (r := json.loads(line)).get("kind") == "train" and since <= r["time"] < until)


def set_user_hold(folder: Path, hold: bool) -> None:
    """Hold the run (or let it go) as `lodger pause --hold` / `lodger resume` do; wait until it answers."""
    from lodger.owner.control import clear_request, notify, run_state, write_request
    from lodger.owner.runlock import lock_pid

    if hold:
        write_request(folder, "user", "hold", "chat latency benchmark: idle condition")
    else:
        clear_request(folder, "user")
    notify(lock_pid(folder) or 0)
    deadline = time.monotonic() + 600
    want = "held" if hold else "running"
    while run_state(folder).get("state") != want:
        if hold is False and run_state(folder).get("by") == "serve":
            break  # still held by the yielding server's grace period: it lets go by itself
        if time.monotonic() > deadline:
            raise SystemExit(f"the run did not become {want} within 600 s")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="The tests' tiny random model (a smoke run).")
    parser.add_argument("--max-tokens", type=int, default=None, help="Tokens per answer (default 64; 32 with --tiny).")
    parser.add_argument("--grace", type=float, default=3.0, help="The job's inference_grace_seconds (default 3).")
    parser.add_argument("--gap", type=float, default=None, help="Seconds before each request (default grace + 1).")
    parser.add_argument("--repeats", type=int, default=1, help="Send the prompt set this many times per condition.")
    args = parser.parse_args()
    max_tokens = args.max_tokens or (32 if args.tiny else 64)
    gap = args.gap if args.gap is not None else args.grace + 1.0
    prompts = PROMPTS * args.repeats
    conditions = ["idle", "yield", "no-yield"]

    common.use_bench_home()
    job, model = write_job(args.tiny, args.grace)
    print(f"# chat latency: model {model}, {len(prompts)} prompts, max_tokens {max_tokens}, greedy, gap {gap} s, "
          f"grace {args.grace} s, job {job}", flush=True)
    print(f"# load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    results: dict[str, list[dict]] = {c: [] for c in conditions}
    servers: dict[str, Server] = {}
    folder = None
    try:
        servers["yield"] = Server(model)
        servers["no-yield"] = Server(model, "--no-yield")
        servers["idle"] = servers["yield"]
        run_id, folder = start_training(job)
        print(f"# training run {run_id} started", flush=True)
        for server in (servers["yield"], servers["no-yield"]):
            ask(server.client(), "Hello!", max_tokens)  # warm-up, not counted
        since = time.time()
        for n, prompt in enumerate(prompts):
            for condition in conditions[n % 3:] + conditions[:n % 3]:
                set_user_hold(folder, condition == "idle")
                time.sleep(gap)  # the run trains (or sleeps) a while; the lease's grace runs out
                r = ask(servers[condition].client(), prompt, max_tokens, folder if condition == "yield" else None)
                results[condition].append(r)
                held = "" if condition != "yield" else ", run held " + (
                    f"{r['held_after']:.3f} s after the request began" if r["held_after"] is not None
                    else "only after the answer ended")
                print(f"#   {condition}: ttft {r['ttft']:.3f} s, total {r['total']:.3f} s, {r['chunks']} chunks{held}",
                      flush=True)
        set_user_hold(folder, False)
        after = [r["held_after"] for r in results["yield"] if r["held_after"] is not None]
        print(f"# yield: the run said held before the answer ended in {len(after)} of {len(results['yield'])} "
              f"requests" + (f", p50 {percentile(after, 50):.3f} s after the request began" if after else ""),
              flush=True)
        held, held_seconds = holds_by_serve(run_id, since)
        print(f"# the yielding server held the run {held} times ({held_seconds:.1f} s in all); the run finished "
              f"{steps_between(folder, since, time.time())} optimizer steps in {time.time() - since:.0f} s",
              flush=True)
    finally:
        for server in servers.values():
            server.close()
        if folder is not None:
            stop_training(folder)
    print(f"# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    texts = {label: [r["text"] for r in rs] for label, rs in results.items()}
    same = all(t == texts["idle"] for t in texts.values())
    print(f"# answers identical across conditions (greedy): {'yes' if same else 'NO'}")
    for label, rs in results.items():
        print(summary(label, rs))
    p50 = {label: percentile([r["total"] for r in rs], 50) for label, rs in results.items()}
    p50_ttft = {label: percentile([r["ttft"] for r in rs], 50) for label, rs in results.items()}
    print(f"ratio yield/idle p50 total {p50['yield'] / p50['idle']:.2f} (goal <= {GOAL_YIELD_RATIO})")
    print(f"ratio yield/idle p50 ttft {p50_ttft['yield'] / p50_ttft['idle']:.2f}")
    print(f"ratio no-yield/idle p50 total {p50['no-yield'] / p50['idle']:.2f}")


if __name__ == "__main__":
    main()
