"""Shared pieces of the side-by-side benchmarks: the job, the isolated home, child processes.

Every benchmark runs lodger and its comparison as child processes of one parent, one after the
other, with the same environment and thread count, and measures each child's wall time and peak
RSS with ``os.wait4`` (per child, not the aggregate of RUSAGE_CHILDREN).

State goes to ``$LODGER_BENCH_HOME`` (default /tmp/lodger-bench-home), never the user's
~/.lodger: the dequantised model and the token cache are built there once, untimed, and reused.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
MODEL_ALIAS = "smollm2-135m-instruct"
SEED = 0
THREADS = 2
BATCH = 4
MAX_LENGTH = 128
LR = 2e-4            # lodger's default peak
MIN_LR_RATIO = 0.1   # lodger's default cosine floor
RANK, ALPHA = 8, 16.0
TARGETS = ("q_proj", "v_proj")


def bench_home() -> Path:
    return Path(os.environ.get("LODGER_BENCH_HOME", "/tmp/lodger-bench-home"))


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every child gets: isolated home, offline, fixed threads, no chatter."""
    env = dict(os.environ)
    env.update({
        "LODGER_HOME": str(bench_home()),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(THREADS),
        "MKL_NUM_THREADS": str(THREADS),
        "PYTHONUNBUFFERED": "1",
    })
    env.pop("LODGER_FAULT", None)
    env.update(extra or {})
    return env


def use_bench_home() -> None:
    """Point this process (and what it imports from lodger) at the bench home."""
    os.environ.update(child_env())
    bench_home().mkdir(parents=True, exist_ok=True)


def train_data() -> Path:
    """The bundled demo data, or a generated chat file when the package has none."""
    bundled = ROOT / "src" / "lodger" / "demo" / "train.jsonl"
    if bundled.is_file():
        return bundled
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures_lib import write_chat_jsonl  # noqa: E402

    path = bench_home() / "bench-train.jsonl"
    if not path.is_file():
        write_chat_jsonl(path, 480, SEED)
    return path


def write_job(folder: Path, steps: int, *, every_steps: int | None = 50, name: str = "bench",
              packing: bool = False, nice: int | None = None) -> Path:
    """The benchmark job: SmolLM2, LoRA r=8 on q/v, batch 4 x 128, 2 threads, no eval. Unpacked
    unless asked: the Trainer sides are fed lodger's padded batches, step for step. ``nice``: the
    job's ``[limits] nice`` (None: lodger's default, 10, kind to the owner's other work)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    ckpt = f"every_steps = {every_steps}" if every_steps else "# every_steps = (off)"
    path.write_text(f"""name = "{name}"
[model]
source = "{MODEL_ALIAS}"
[method]
kind = "lora"
rank = {RANK}
alpha = {ALPHA}
dropout = 0.0
target_modules = {json.dumps(list(TARGETS))}
[data]
train = "{train_data()}"
eval_fraction = 0.0
max_length = {MAX_LENGTH}
[training]
steps = {steps}
batch_size = {BATCH}
learning_rate = {LR}
min_lr_ratio = {MIN_LR_RATIO}
seed = {SEED}
threads = {THREADS}
log_every = 1000000
packing = {"true" if packing else "false"}
[checkpoints]
{ckpt}
keep_last = 3
{"" if nice is None else f"[limits]{chr(10)}nice = {nice}"}
""")
    return path


def warm_caches(job_path: Path) -> dict:
    """Dequantise the model and tokenise the data once (untimed); return what children need."""
    use_bench_home()
    from lodger.lifecycle.jobfile import load_job
    from lodger.lifecycle.prepare import prepare

    started = time.perf_counter()
    p = prepare(load_job(job_path))
    return {"folder": str(p.folder), "train": str(p.train_file.path), "examples": len(p.train_indices),
            "pad_id": p.tokenizer.pad_token_id, "seconds": time.perf_counter() - started}


def lora_model(folder: Path):
    """The bench's LoRA model, built the same way on every side (the seed fixes the LoRA init)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
    model.config.use_cache = False
    torch.manual_seed(SEED)
    return get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(TARGETS),
                                            bias="none", task_type="CAUSAL_LM"))


def batch_order(n_examples: int, steps: int, batch: int = BATCH, seed: int = SEED) -> list[list[int]]:
    """The example indices of every step, exactly as lodger's sampler draws them."""
    from lodger.data.chats import Sampler

    sampler = Sampler(list(range(n_examples)), seed)
    return [[sampler.at(s * batch + k) for k in range(batch)] for s in range(steps)]


@dataclass
class ChildResult:
    """One child process: exit status, wall seconds, peak RSS, its output."""

    argv: list[str]
    returncode: int
    wall: float
    peak_rss: int          # bytes (ru_maxrss of this child alone, via wait4)
    cpu: float             # user + system seconds of this child alone
    stdout: str
    stderr: str
    extra: dict = field(default_factory=dict)

    def check(self) -> "ChildResult":
        if self.returncode != 0:
            raise SystemExit(f"child failed ({self.returncode}): {' '.join(self.argv)}\n"
                             f"--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}")
        return self


def run_child(argv: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> ChildResult:
    """Run a child to the end; wall time from fork to reap, peak RSS of that child only."""
    out_path = bench_home() / f".child-{os.getpid()}.out"
    err_path = bench_home() / f".child-{os.getpid()}.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env or child_env(), cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
    result = ChildResult(argv, proc.returncode, wall, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime,
                         out_path.read_text(), err_path.read_text())
    out_path.unlink(missing_ok=True)
    err_path.unlink(missing_ok=True)
    return result


def lodger_bin() -> str:
    found = Path(sys.executable).with_name("lodger")
    return str(found) if found.exists() else shutil.which("lodger") or "lodger"


def run_lodger(job_path: Path) -> ChildResult:
    """`lodger run JOB --quiet` in a child; attaches its per-step records and checkpoint times."""
    result = run_child([lodger_bin(), "run", str(job_path), "--quiet"]).check()
    run_id = next(line.split()[1] for line in result.stdout.splitlines() if line.startswith("run "))
    folder = bench_home() / "runs" / run_id
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r["kind"] == "train"]
    ckpts = []
    for line in (folder / "log.txt").read_text().splitlines():
        if " checkpoint step " in line and " committed in " in line:
            ckpts.append(float(line.split(" committed in ")[1].split()[0]))
    result.extra = {"run_id": run_id, "losses": [r["loss"] for r in steps],
                    "ends": [r["time"] for r in steps], "seconds": [r["seconds"] for r in steps],
                    "checkpoint_seconds": ckpts, "folder": str(folder)}
    return result


def loop_span(ends: list[float], seconds: list[float]) -> float:
    """Start of the first step to the end of the last (each step's end stamp minus its duration)."""
    return ends[-1] - (ends[0] - seconds[0])


def steady_steps_per_s(ends: list[float]) -> float:
    """Steps per second from the end of step 1 to the end of the last step (step 1 warms up)."""
    return (len(ends) - 1) / (ends[-1] - ends[0])


def max_abs_diff(a: list[float], b: list[float]) -> float:
    n = min(len(a), len(b))
    return max((abs(x - y) for x, y in zip(a[:n], b[:n])), default=float("nan"))


def median(values: list[float]) -> float:
    return statistics.median(values)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def ratio_line(label: str, what: str, ratio: float, detail: str, goal: str | None = None) -> str:
    return f"{label}: {what} {ratio:.2f} ({detail}{'; goal ' + goal if goal else ''})"


def run_script_child(script: str, flag: str, steps: int) -> ChildResult:
    """Run ``script flag --steps N --out FILE`` as a child; its JSON report becomes ``result.extra``."""
    out = bench_home() / f".{flag.strip('-')}-{os.getpid()}.json"
    result = run_child([sys.executable, script, flag, "--steps", str(steps), "--out", str(out)]).check()
    result.extra = json.loads(out.read_text())
    out.unlink()
    return result


# -- the two training benchmarks' shared harness ------------------------------------------------
def side_by_side_args(doc: str, child_flag: str):
    """Options of a lodger-vs-X training benchmark; the hidden ``child_flag`` and --out run X's side.

    With ``child_flag`` given, the caller runs its child and returns; otherwise --quick is applied."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=50, help="lodger checkpoint interval (steps)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side, alternating the order")
    parser.add_argument("--quick", action="store_true", help="20 steps, checkpoints every 10")
    parser.add_argument(child_flag, dest="child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    use_bench_home()
    if args.quick and not args.child:
        args.steps, args.every = 20, 10
    return args


def prepared_job(steps: int, every: int, name: str) -> tuple[Path, dict]:
    """The benchmark job in a fresh folder under the bench home, its caches warmed (untimed). At
    nice 0, the priority of the side it is compared with: lodger's default nice 10 hands the cores
    to the other side whenever anything else runs, which measures the policy, not the speed."""
    import tempfile

    jobs = Path(tempfile.mkdtemp(prefix="jobs-", dir=bench_home()))
    job = write_job(jobs, steps, every_steps=every, name=name, nice=0)
    return job, warm_caches(job)


def alternate(job: Path, script: str, child_flag: str, other: str, args, report) -> dict[str, list[ChildResult]]:
    """``lodger run JOB`` and ``script child_flag`` (side ``other``), ``args.repeats`` times each, who
    goes first alternating; ``report(side, result)`` sees each result as it comes."""
    runs: dict[str, list[ChildResult]] = {"lodger": [], other: []}
    for rep in range(args.repeats):
        for side in ((other, "lodger") if rep % 2 == 0 else ("lodger", other)):
            result = run_lodger(job) if side == "lodger" else run_script_child(script, child_flag, args.steps)
            report(side, result)
            runs[side].append(result)
    return runs
