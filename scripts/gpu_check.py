"""One-shot check of lodger's CUDA paths, run through the real `lodger` command.

Checks, in order of importance (each one skipped when the time budget is spent):
  precision  `lodger run` in bf16, fp16 (loss scaling: the GradScaler's scale from each checkpoint)
             and fp32: losses finite and decreasing, scaler state in the checkpoint
  memory     the pre-flight GPU estimate (recorded in the ledger) and `lodger estimate --json`
             against torch.cuda.max_memory_allocated / max_memory_reserved of the same run
  determinism two identical runs (fp32 and bf16): bitwise-equal losses and adapter; the settings
             lodger applied (CUBLAS_WORKSPACE_CONFIG, deterministic algorithms, cuDNN flags)
  resume     a run SIGKILLed after its first checkpoint, `lodger resume`, `lodger compare` with the
             uninterrupted run (fp32 and fp16)

Usage (scripts/gpu_check.sh sets PYTHONPATH and OUT):
    python scripts/gpu_check.py [--cpu] [--out DIR] [--budget SECONDS]
--cpu runs the same checks on the CPU with the tiny model (fp16 must then be refused), to test
this script where there is no GPU. Internally `gpu_check.py _lodger STATS -- ARGS...` runs the
lodger CLI in this process and writes the process's peak memory and determinism settings to STATS.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


# -- the in-process lodger wrapper ------------------------------------------------------------
def _dump_stats(path: str) -> None:
    """At exit: peak memory and the determinism settings this lodger process ended with."""
    import resource

    stats: dict = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
    torch = sys.modules.get("torch")
    if torch is not None:
        stats.update({
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "sdp_flash": torch.backends.cuda.flash_sdp_enabled(),
            "sdp_mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "sdp_math": torch.backends.cuda.math_sdp_enabled(),
        })
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            free, total = torch.cuda.mem_get_info()
            stats.update({"max_allocated": torch.cuda.max_memory_allocated(),
                          "max_reserved": torch.cuda.max_memory_reserved(),
                          "device_used_at_exit": total - free})
    Path(path).write_text(json.dumps(stats, indent=1))


def _experiments() -> None:
    """Candidate fixes tried without editing lodger (environment switches of this script only)."""
    if os.environ.get("GPU_CHECK_NO_CUDNN_SDP") == "1":  # no cuDNN attention: its backward is nondeterministic
        import torch

        torch.backends.cuda.enable_cudnn_sdp(False)
    if os.environ.get("GPU_CHECK_SCALER_UPDATE_ON_SKIP") == "1":
        # As if loop.py called scaler.update() after a step skipped for a non-finite loss: done before
        # the next step's first scale(), so that step scales and unscales with the same factor.
        from lodger.train import precision as P

        backward, unscale, step = P.Precision.backward, P.Precision.unscale, P.Precision.step

        def patched_backward(self, loss):
            if self.scaler is not None and getattr(self, "_unstepped", False):
                self.scaler.update()
                self._unstepped = False
            backward(self, loss)

        def patched_unscale(self, optimizer):
            unscale(self, optimizer)
            self._unstepped = self.scaler is not None

        def patched_step(self, optimizer):
            step(self, optimizer)
            self._unstepped = False

        P.Precision.backward, P.Precision.unscale, P.Precision.step = patched_backward, patched_unscale, patched_step


def _strict_determinism() -> None:
    """As if configure_determinism used warn_only=False on CUDA (SDPA then picks deterministic kernels)."""
    from lodger.train import determinism as S  # (the fix has landed there: strict on CUDA)

    configure = S.configure_determinism

    def strict(device: str) -> None:
        configure(device)
        if device == "cuda":
            import torch

            torch.use_deterministic_algorithms(True, warn_only=False)

    S.configure_determinism = strict


def wrapped_lodger(stats: str, args: list[str]) -> None:
    if stats != "-":
        atexit.register(_dump_stats, stats)
    _experiments()
    if os.environ.get("GPU_CHECK_STRICT_DETERMINISM") == "1":
        _strict_determinism()
    from lodger.cli.main import cli

    cli.main(args=args, prog_name="lodger")


# -- the report ---------------------------------------------------------------------------------
class Report:
    """Summary lines to the terminal and $OUT/gpu_check.txt as they come; the full log beside it."""

    def __init__(self, out: Path):
        self.out = out
        self.summary = out / "gpu_check.txt"
        self.log = out / "gpu_check_log.txt"
        self.summary.write_text("")
        self.log.write_text("")
        self.passed, self.failed, self.skipped = [], [], []

    def line(self, text: str) -> None:
        print(text, flush=True)
        with self.summary.open("a") as fh:
            fh.write(text + "\n")

    def result(self, name: str, ok: bool | None, detail: str) -> None:
        tag = {True: "PASS", False: "FAIL", None: "INFO"}[ok]
        (self.passed if ok else self.failed if ok is False else []).append(name)
        self.line(f"[{tag}] {name}: {detail}")

    def skip(self, name: str, why: str) -> None:
        self.skipped.append(name)
        self.line(f"[SKIP] {name}: {why}")

    def append_log(self, title: str, text: str) -> None:
        with self.log.open("a") as fh:
            fh.write(f"\n===== {title}\n{text}\n")


# -- fixtures -----------------------------------------------------------------------------------
def long_text_jsonl(path: Path, n: int, seed: int, per_line: int) -> Path:
    """Lines of ``per_line`` toy question/answer records each: long examples fill max_length."""
    from fixtures_lib import make_text_records

    records = make_text_records(n * per_line, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for i in range(n):
            text = "\n".join(r["text"] for r in records[i * per_line:(i + 1) * per_line])
            fh.write(json.dumps({"text": text}) + "\n")
    return path


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value))


def write_job(path: Path, sections: dict[str, dict]) -> Path:
    lines = []
    for section, values in sections.items():
        lines += [f"[{section}]"] + [f"{k} = {_toml(v)}" for k, v in values.items()] + [""]
    path.write_text("\n".join(lines))
    return path


# -- running lodger -----------------------------------------------------------------------------
class Checker:
    def __init__(self, args):
        self.cpu = args.cpu
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work)
        if self.work.exists():
            shutil.rmtree(self.work)
        (self.work / "logs").mkdir(parents=True)
        self.report = Report(self.out)
        self.deadline = time.monotonic() + args.budget
        self.env = {**os.environ, "LODGER_HOME": str(self.work / "home"), "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.env.pop("LODGER_FAULT", None)
        self.calls = 0
        self.runs: dict[str, dict] = {}   # label -> {"id", "dir", "stats", "seconds", "stderr"}
        self.shown: dict[str, dict] = {}  # run id -> `lodger show --json` of a finished run

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def _command(self, args: list[str], stats: str = "-") -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "_lodger", stats, "--", *map(str, args)]

    def lodger(self, label: str, args: list[str], stats: str = "-", timeout: float = 240, env: dict | None = None):
        """Run `lodger ARGS` to completion; its output goes to the log. Returns (rc, stdout, stderr, seconds)."""
        self.calls += 1
        limit = max(5.0, min(timeout, self.left()))
        started = time.monotonic()
        try:
            done = subprocess.run(self._command(args, stats), env={**self.env, **(env or {})}, cwd=self.work,
                                  capture_output=True,
                                  text=True, timeout=limit)
            rc, out, err = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out, err = "timeout", _text(exc.stdout), _text(exc.stderr)
        seconds = time.monotonic() - started
        self.report.append_log(f"{label}: lodger {' '.join(map(str, args))} -> exit {rc} in {seconds:.1f} s",
                               f"--- stdout\n{out}\n--- stderr\n{err}")
        return rc, out, err, seconds

    def train(self, label: str, job: Path, measure: bool = True) -> dict | None:
        stats = self.work / "logs" / f"{label}.stats.json"
        rc, out, err, seconds = self.lodger(label, ["run", job], str(stats) if measure else "-")
        first = out.splitlines()[0] if out.strip() else ""
        if rc != 0 or not first.startswith("run "):
            self.report.result(label, False, f"`lodger run` exit {rc}: {_tail(err or out)}")
            return None
        run_id = first.split()[1]
        run = {"id": run_id, "dir": self.work / "home" / "runs" / run_id, "seconds": seconds, "stderr": err,
               "stats": json.loads(stats.read_text()) if stats.exists() else {}}
        self.runs[label] = run
        return run

    def show(self, run_id: str) -> dict:
        if run_id not in self.shown:
            rc, out, err, _ = self.lodger(f"show {run_id}", ["show", run_id, "--json"])
            self.shown[run_id] = json.loads(out) if rc == 0 else {}
        return self.shown[run_id]


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def train_records(run_dir: Path) -> list[dict]:
    return [{k: r.get(k) for k in ("step", "loss", "grad_norm", "lr", "tokens")}
            for r in metrics(run_dir) if r["kind"] == "train"]


def adapter_sha(run_dir: Path) -> str | None:
    path = run_dir / "adapter" / "adapter_model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def checkpoints(run_dir: Path) -> list[Path]:
    folder = run_dir / "checkpoints"
    return sorted(folder.glob("step-*")) if folder.exists() else []


# -- the checks ----------------------------------------------------------------------------------
def check_precision(c: Checker, label: str, job: Path) -> dict | None:
    run = c.train(label, job)
    if run is None:
        return None
    records = [r for r in metrics(run["dir"]) if r["kind"] == "train"]
    losses = [r["loss"] for r in records]
    skipped = [r["step"] for r in records if r.get("skipped")]
    finite = all(math.isfinite(x) for x in losses)
    k = max(1, len(losses) // 5)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    decreasing = last < first
    evals = [(r["step"], round(r["eval_loss"], 4)) for r in metrics(run["dir"]) if r["kind"] == "eval"]
    s = run["stats"]
    mem = (f"; max_allocated {s['max_allocated'] / GiB:.3f} GiB, max_reserved {s['max_reserved'] / GiB:.3f} GiB"
           if "max_allocated" in s else f"; peak RSS {s.get('peak_rss_bytes', 0) / GiB:.2f} GiB")
    c.report.result(f"{label} run", finite and decreasing and bool(losses),
                    f"{len(losses)} steps in {run['seconds']:.1f} s (process), losses finite={finite}, mean of "
                    f"first {k} {first:.4f} -> last {k} {last:.4f} (decreasing={decreasing}), skipped steps "
                    f"{skipped or 'none'}, eval {evals}{mem}")
    return run


def check_scaler(c: Checker, run: dict) -> None:
    rows, missing = [], []
    for ckpt in checkpoints(run["dir"]):
        state = json.loads((ckpt / "state.json").read_text())
        scaler = state.get("scaler") or {}
        if "scale" not in scaler:
            missing.append(ckpt.name)
        rows.append(f"{ckpt.name.removeprefix('step-').lstrip('0')}: scale {scaler.get('scale')} "
                    f"growth_tracker {scaler.get('_growth_tracker')}")
    in_metrics = any("scale" in r for r in metrics(run["dir"]))
    c.report.result("fp16 grad scaler in checkpoints", bool(rows) and not missing,
                    ("; ".join(rows) or "no checkpoints") + (f"; MISSING in {missing}" if missing else "")
                    + f"; scale recorded in metrics.jsonl: {in_metrics}")


def check_poisoned_step(c: Checker, job: Path, precision: str) -> None:
    """A non-finite loss at step 3 (test-only fault injection) must be skipped and training go on.

    With fp16 this is the GradScaler path: unscale_() ran for the bad step, so unless the scaler is
    updated the next step's unscale_() raises "unscale_() has already been called"."""
    from lodger.data.chats import Sampler

    text = job.read_text()
    sections = {"training": {}}
    for line in text.splitlines():  # the job's shape: batch_size x grad_accum examples per step
        if line.startswith(("batch_size", "grad_accum")):
            key, value = (x.strip() for x in line.split("="))
            sections["training"][key] = int(value)
    per_step = sections["training"]["batch_size"] * sections["training"]["grad_accum"]
    sampler = Sampler(list(range(64)), 0)  # 64 train lines, seed 0, explicit eval file: no split
    lines = sorted({sampler.at(2 * per_step + k) + 1 for k in range(per_step)})  # step 3's lines (1-based)
    poisoned = job.with_name(f"job-{precision.split()[0]}-poisoned.toml")
    # 4 steps, all inside the first pass over the data: step 3's lines return in most steps of the next
    poisoned.write_text(text.replace("steps = 40", "steps = 4").replace("steps = 12", "steps = 4"))
    label = f"{precision} non-finite step skipped"
    rc, out, err, seconds = c.lodger(label, ["run", poisoned], env={"LODGER_TEST_POISON_LINES": ",".join(map(str, lines))})
    run_id = out.split()[1] if out.startswith("run ") else None
    records = [r for r in metrics(c.work / "home" / "runs" / run_id) if r["kind"] == "train"] if run_id else []
    skipped = [r["step"] for r in records if r.get("skipped")]
    ok = rc == 0 and 3 in skipped and len(records) == 4  # fp16 may also skip overflowing steps
    c.report.result(label, ok, f"poisoned lines {lines[:4]}... (step 3): exit {rc}, {len(records)} train records, "
                    f"skipped steps {skipped}, losses {[round(r['loss'], 4) for r in records]}"
                    + ("" if rc == 0 else f"; stderr: {_tail(err, 4)}"))


def check_memory(c: Checker, label: str, run: dict, estimate_cli: dict | None = None) -> None:
    info = c.show(run["id"])
    created = next((e["data"] for e in info.get("events", []) if e["kind"] == "created"), {})
    est = created.get("memory_estimate")
    s = run["stats"]
    if not est:
        c.report.result(f"memory {label}", False, "no memory_estimate in the ledger's created event")
        return
    total, items = est["total_bytes"], est["items"]
    runtime = items.get("runtime", 0)
    parts = ", ".join(f"{k} {v / GiB:.3f}" for k, v in items.items())
    if "max_allocated" in s:
        alloc, reserved, used = s["max_allocated"], s["max_reserved"], s["device_used_at_exit"]
        peak_events = max((e["data"].get("compute", {}).get("peak_gpu_bytes") or 0 for e in info["events"]
                           if "compute" in e["data"]), default=0)
        ratio_a = (total - runtime) / alloc if alloc else float("nan")
        ratio_r = (total - runtime) / reserved if reserved else float("nan")
        ratio_u = total / used if used else float("nan")
        ok = 0.8 <= ratio_r <= 2.0
        c.report.result(
            f"memory {label}", ok,
            f"pre-flight estimate on {est['device']} {total / GiB:.3f} GiB (runtime {runtime / GiB:.3f} of it; "
            f"overlap -{est.get('overlap_bytes', 0) / GiB:.3f}) vs measured max_allocated {alloc / GiB:.3f} GiB "
            f"(ratio excl. runtime {ratio_a:.2f}), max_reserved {reserved / GiB:.3f} GiB (ratio {ratio_r:.2f}), "
            f"device used at exit {used / GiB:.3f} GiB (ratio incl. runtime {ratio_u:.2f}); ledger "
            f"peak_gpu_bytes {peak_events / GiB:.3f} GiB; items GiB: {parts}")
    else:
        rss = s.get("peak_rss_bytes", 0)
        c.report.result(f"memory {label}", None,
                        f"pre-flight estimate on {est['device']} {total / GiB:.3f} GiB vs peak RSS "
                        f"{rss / GiB:.3f} GiB (ratio {total / max(rss, 1):.2f}); items GiB: {parts}")
    if estimate_cli:
        e = estimate_cli["estimate"]
        c.report.result(f"`lodger estimate --json` {label}", e["device"] == ("cpu" if c.cpu else "cuda"),
                        f"device {e['device']}, total {e['total_bytes'] / GiB:.3f} GiB (pre-flight said "
                        f"{total / GiB:.3f} on {est['device']}), available_bytes "
                        f"{estimate_cli['available_bytes'] / GiB:.1f} "
                        f"GiB, fits {estimate_cli['fits']}")


def determinism_settings(c: Checker, run: dict) -> None:
    info = c.show(run["id"])
    prov = (info.get("provenance") or [{}])[0]
    s = run["stats"]
    keys = ("CUBLAS_WORKSPACE_CONFIG", "deterministic_algorithms", "deterministic_warn_only",
            "cudnn_deterministic", "cudnn_benchmark", "matmul_allow_tf32", "cudnn_allow_tf32",
            "float32_matmul_precision", "sdp_flash", "sdp_mem_efficient", "sdp_math")
    applied = ", ".join(f"{k}={s.get(k)}" for k in keys)
    c.report.result("determinism settings applied by lodger", None,
                    f"{applied}; provenance env {prov.get('env')}; provenance determinism {prov.get('determinism')}; "
                    f"cuda {((prov.get('hardware') or {}).get('cuda'))}")
    warned = sorted({line.strip()[:240] for r in c.runs.values() for line in r["stderr"].splitlines()
                     if "determinis" in line.lower()})
    c.report.result("nondeterminism warnings in lodger's stderr", not warned, " || ".join(warned) or "none")


def compare_runs(c: Checker, label: str, a: dict, b: dict) -> None:
    ra, rb = train_records(a["dir"]), train_records(b["dir"])
    same_records = ra == rb and bool(ra)
    diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(ra, rb)]
    first_diff = next((x["step"] for x, y in zip(ra, rb) if x != y), None)
    sha_a, sha_b = adapter_sha(a["dir"]), adapter_sha(b["dir"])
    rc, out, err, _ = c.lodger(f"compare {label}", ["compare", a["id"], b["id"], "--json"])
    verdict = json.loads(out).get("verdict") if out.strip().startswith("{") else f"exit {rc}: {_tail(err)}"
    c.report.result(label, same_records and sha_a == sha_b and sha_a is not None,
                    f"{len(ra)} vs {len(rb)} train records, bitwise equal (loss, grad_norm, lr, tokens): "
                    f"{same_records}" + (f" (first difference at step {first_diff}, max |loss diff| "
                                         f"{max(diffs):.3g})" if not same_records and diffs else "")
                    + f"; adapter bytes equal: {sha_a == sha_b and sha_a is not None}; `lodger compare` exit {rc}, "
                    f"verdict: {verdict}")


def kill_and_resume(c: Checker, label: str, job: Path, baseline: dict) -> None:
    log = c.work / "logs" / f"{label}.out"
    started = time.monotonic()
    with open(log, "w") as fo, open(c.work / "logs" / f"{label}.err", "w") as fe:
        proc = subprocess.Popen(c._command(["run", job]), env=c.env, cwd=c.work, stdout=fo, stderr=fe)
    run_id, seen, killed_at = None, None, None
    try:
        limit = time.monotonic() + min(120, c.left())
        while time.monotonic() < limit and proc.poll() is None:
            if run_id is None:
                text = log.read_text()
                if "\n" in text and text.startswith("run "):
                    run_id = text.split()[1]
            if run_id is not None:
                found = checkpoints(c.work / "home" / "runs" / run_id)
                if found:
                    seen = found[-1].name
                    proc.send_signal(signal.SIGKILL)
                    break
            time.sleep(0.002)  # a short poll inside a bounded wait for an observed state
    finally:
        if proc.poll() is None and seen is None:
            proc.kill()
        rc = proc.wait(timeout=60)
    c.report.append_log(f"{label}: killed run", f"{log.read_text()}\n--- stderr\n"
                        f"{(c.work / 'logs' / f'{label}.err').read_text()}")
    if run_id is None or seen is None or rc != -signal.SIGKILL:
        c.report.result(label, False, f"no kill after a checkpoint (run {run_id}, checkpoint {seen}, exit {rc}, "
                        f"{time.monotonic() - started:.1f} s)")
        return
    folder = c.work / "home" / "runs" / run_id
    killed_at = max((r["step"] for r in train_records(folder)), default=0)
    rc, out, err, seconds = c.lodger(f"{label} resume", ["resume", run_id])
    restored = next((line for line in out.splitlines() if "restored checkpoint" in line or "starting again" in line),
                    "?")
    drift = [line for line in (out + err).splitlines() if "drift" in line or "no longer bitwise" in line]
    c.report.result(f"{label} (kill -9 + resume)", rc == 0,
                    f"SIGKILL after {seen} appeared (metrics reached step {killed_at}); resume exit {rc} in "
                    f"{seconds:.1f} s, {restored.strip()}" + (f"; DRIFT: {drift}" if drift else ""))
    if rc != 0:
        return
    resumed = {"id": run_id, "dir": folder}
    compare_runs(c, f"{label}: resumed vs uninterrupted", resumed, baseline)
    if baseline.get("scaler_check"):
        last = checkpoints(folder)[-1].name
        mine = json.loads((folder / "checkpoints" / last / "state.json").read_text()).get("scaler")
        theirs_path = baseline["dir"] / "checkpoints" / last / "state.json"
        theirs = json.loads(theirs_path.read_text()).get("scaler") if theirs_path.exists() else None
        c.report.result(f"{label}: scaler state at {last}", mine == theirs and bool(mine),
                        f"resumed {mine} vs uninterrupted {theirs}")


# -- main ------------------------------------------------------------------------------------------
def build_fixtures(c: Checker) -> dict[str, Path]:
    from fixtures_lib import build_tiny_model

    if c.cpu:
        model = build_tiny_model(c.work / "model", seed=0)
        shape = dict(steps=12, batch_size=4, max_length=64, every=4, per_line=3)
    else:
        # Big enough that activations and the caching allocator dominate (about 90M parameters).
        model = build_tiny_model(c.work / "model", seed=0, hidden=1024, layers=8, heads=16, kv_heads=4,
                                 intermediate=2816)
        shape = dict(steps=40, batch_size=8, max_length=512, every=10, per_line=32)
    train = long_text_jsonl(c.work / "data" / "train.jsonl", 64, 0, shape["per_line"])
    eval_ = long_text_jsonl(c.work / "data" / "eval.jsonl", 8, 1, shape["per_line"])
    jobs = {}
    for precision in ("bf16", "fp16", "fp32"):
        sections = {
            "model": {"source": str(model)},
            "method": {"kind": "lora", "rank": 8, "alpha": 16.0, "dropout": 0.1,
                       "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                          "down_proj"]},
            "data": {"train": str(train), "eval": str(eval_), "max_length": shape["max_length"]},
            "training": {"steps": shape["steps"], "batch_size": shape["batch_size"], "grad_accum": 2,
                         "learning_rate": 2e-3, "seed": 0, "threads": 1 if c.cpu else 4,
                         "device": "cpu" if c.cpu else "cuda", "precision": precision,
                         "eval_every": shape["every"]},
            "checkpoints": {"every_steps": shape["every"], "keep_last": 20},
        }
        jobs[precision] = write_job(c.work / f"job-{precision}.toml", sections)
    # Full fine-tuning, for the memory estimate only: a few steps, one checkpoint at the end.
    sections["method"] = {"kind": "full"}
    sections["training"].update(steps=4, precision="bf16", eval_every=4)
    sections["checkpoints"] = {"every_steps": 0, "keep_last": 2}
    jobs["full"] = write_job(c.work / "job-full-bf16.toml", sections)
    return jobs


def environment(c: Checker) -> None:
    import torch

    cuda = torch.cuda.is_available()
    c.report.result("environment", cuda or c.cpu,
                    f"python {sys.version.split()[0]}, torch {torch.__version__}, torch.version.cuda "
                    f"{torch.version.cuda}, cudnn {torch.backends.cudnn.version() if cuda else None}, "
                    f"cuda available {cuda}, devices "
                    f"{[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU with the tiny model (script test)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_check_out")
    parser.add_argument("--work", default="/tmp/gpu_check_work")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for all checks together")
    parser.add_argument("--third", action="store_true",
                        help="only: the fp16 non-finite step with scaler.update() on skip, and bf16 determinism "
                             "and fp16 resume with torch.use_deterministic_algorithms(True) (warn_only=False)")
    parser.add_argument("--second", action="store_true",
                        help="only the follow-up checks: `lodger estimate`, and bf16/fp16 determinism, fp16 "
                             "resume and the fp16 non-finite step with the candidate fixes (see _experiments)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    c = Checker(args)
    r = c.report
    r.line(f"lodger GPU check ({'CPU test mode' if c.cpu else 'CUDA'}), {time.strftime('%Y-%m-%d %H:%M:%S')}")
    try:
        environment(c)
        started = time.monotonic()
        jobs = build_fixtures(c)
        r.result("fixtures", True, f"model + data + jobs built in {time.monotonic() - started:.1f} s")
        run_third(c, jobs) if args.third else run_second(c, jobs) if args.second else run_all(c, jobs)
    except Exception as exc:  # the summary must still say what happened
        import traceback

        r.result("script", False, f"{type(exc).__name__}: {exc}")
        r.append_log("script exception", traceback.format_exc())
    r.line(f"RESULT: {len(r.passed)} passed, {len(r.failed)} failed ({', '.join(r.failed) or '-'}), "
           f"{len(r.skipped)} skipped; {c.calls} lodger calls; {c.left():.0f} s of budget left")
    return 1 if r.failed else 0


def run_second(c: Checker, jobs: dict[str, Path]) -> None:
    """Follow-up of the first GPU run: the estimate command, and the candidate fixes."""
    r = c.report
    rc, out, err, _ = c.lodger("estimate", ["estimate", jobs["bf16"], "--json"])
    if out.strip().startswith("{"):
        e = json.loads(out)
        r.result("`lodger estimate --json` bf16", e["estimate"]["device"] == ("cpu" if c.cpu else "cuda"),
                 f"device {e['estimate']['device']}, total {e['estimate']['total_bytes'] / GiB:.3f} GiB, items "
                 f"{ {k: round(v / GiB, 3) for k, v in e['estimate']['items'].items()} }, available_bytes "
                 f"{e['available_bytes'] / GiB:.1f} GiB, fits {e['fits']}, flops_per_second {e['flops_per_second']:.3g}")
    else:
        r.result("`lodger estimate --json` bf16", False, f"exit {rc}: {_tail(err)}")
    guarded = "bf16" if c.cpu else "fp16"
    c.env["GPU_CHECK_SCALER_UPDATE_ON_SKIP"] = "1"
    check_poisoned_step(c, jobs[guarded], f"{guarded} + scaler.update() on skip")
    c.env.pop("GPU_CHECK_SCALER_UPDATE_ON_SKIP")
    c.env["GPU_CHECK_NO_CUDNN_SDP"] = "1"
    r.line("(from here on: cuDNN SDPA disabled in every lodger process: torch.backends.cuda.enable_cudnn_sdp(False))")
    for precision in ("bf16",) if c.cpu else ("bf16", "fp16"):
        first = c.train(f"{precision} no-cudnn-sdp", jobs[precision], measure=True)
        if not first or c.left() < 30:
            continue
        if precision == "bf16":
            again = c.train(f"{precision} no-cudnn-sdp again", jobs[precision], measure=False)
            if again:
                compare_runs(c, f"determinism {precision} without cuDNN SDPA", first, again)
        else:
            first["scaler_check"] = True
            kill_and_resume(c, f"resume {precision} without cuDNN SDPA", jobs[precision], first)
    warned = sorted({line.strip()[:240] for run in c.runs.values() for line in run["stderr"].splitlines()
                     if "determinis" in line.lower()})
    r.result("nondeterminism warnings without cuDNN SDPA", not warned, " || ".join(warned) or "none")


def run_third(c: Checker, jobs: dict[str, Path]) -> None:
    """Follow-up of the second GPU run: both candidate fixes, each as lodger would apply it."""
    r = c.report
    guarded = "bf16" if c.cpu else "fp16"
    c.env["GPU_CHECK_SCALER_UPDATE_ON_SKIP"] = "1"
    check_poisoned_step(c, jobs[guarded], f"{guarded} + scaler.update() on skip")
    c.env.pop("GPU_CHECK_SCALER_UPDATE_ON_SKIP")
    c.env["GPU_CHECK_STRICT_DETERMINISM"] = "1"
    r.line("(from here on: torch.use_deterministic_algorithms(True, warn_only=False) on CUDA in every lodger process)")
    for precision in ("bf16",) if c.cpu else ("bf16", "fp16"):
        first = c.train(f"{precision} strict", jobs[precision], measure=True)
        if not first:
            continue
        s = first["stats"]
        r.result(f"{precision} strict run", None, f"{first['seconds']:.1f} s (process), deterministic_warn_only "
                 f"{s.get('deterministic_warn_only')}, max_allocated {s.get('max_allocated', 0) / GiB:.3f} GiB, "
                 f"max_reserved {s.get('max_reserved', 0) / GiB:.3f} GiB")
        if c.left() < 30:
            continue
        if precision == "bf16":
            again = c.train(f"{precision} strict again", jobs[precision], measure=False)
            if again:
                compare_runs(c, f"determinism {precision} with warn_only=False", first, again)
        else:
            first["scaler_check"] = True
            kill_and_resume(c, f"resume {precision} with warn_only=False", jobs[precision], first)
    warned = sorted({line.strip()[:240] for run in c.runs.values() for line in run["stderr"].splitlines()
                     if "determinis" in line.lower()})
    r.result("nondeterminism warnings with warn_only=False", not warned, " || ".join(warned) or "none")


def run_all(c: Checker, jobs: dict[str, Path]) -> None:
    r = c.report
    base: dict[str, dict | None] = {}
    for precision in ("bf16", "fp16", "fp32"):
        if c.cpu and precision == "fp16":
            rc, out, err, _ = c.lodger("fp16 on cpu", ["run", jobs["fp16"]])
            r.result("fp16 refused on the CPU", rc != 0 and "fp16" in err, f"exit {rc}: {_tail(err)}")
            continue
        if c.left() < 30:
            r.skip(f"{precision} run", "time budget spent")
            continue
        base[precision] = check_precision(c, precision, jobs[precision])
    if base.get("fp16"):
        base["fp16"]["scaler_check"] = True
        check_scaler(c, base["fp16"])
    guarded = "bf16" if c.cpu else "fp16"  # on the CPU only the script's own path is tested
    if c.left() > 40:
        check_poisoned_step(c, jobs[guarded], guarded)
    else:
        r.skip(f"{guarded} non-finite step skipped", "time budget spent")
    for i, precision in enumerate(("bf16", "fp16", "fp32")):
        if base.get(precision):
            estimate = None
            if i == 0 and c.left() > 40:
                rc, out, err, _ = c.lodger("estimate", ["estimate", jobs[precision], "--json"])
                estimate = json.loads(out) if out.strip().startswith("{") else None
                if estimate is None:
                    r.result("`lodger estimate --json`", False, f"exit {rc}: {_tail(err)}")
            check_memory(c, f"{precision} LoRA", base[precision], estimate)
    if base.get("fp32") or base.get("bf16"):
        determinism_settings(c, base.get("fp32") or base.get("bf16"))
    for precision in ("fp32", "bf16"):
        if not base.get(precision):
            continue
        if c.left() < 30:
            r.skip(f"determinism {precision}", "time budget spent")
            continue
        again = c.train(f"{precision} again", jobs[precision], measure=False)
        if again:
            compare_runs(c, f"determinism {precision}: two identical runs", base[precision], again)
    for precision in ("fp32", "fp16"):
        if not base.get(precision):
            continue
        if c.left() < 40:
            r.skip(f"resume {precision}", "time budget spent")
            continue
        kill_and_resume(c, f"resume {precision}", jobs[precision], base[precision])
    if c.left() > 60:
        full = c.train("full bf16", jobs["full"])
        if full:
            check_memory(c, "bf16 full fine-tuning", full)
    else:
        r.skip("memory bf16 full fine-tuning", "time budget spent")
    if base.get("bf16"):  # nondeterminism warnings raised by the repeat runs too
        warned = sorted({line.strip()[:240] for run in c.runs.values() for line in run["stderr"].splitlines()
                         if "determinis" in line.lower()})
        if warned:
            r.result("nondeterminism warnings (all runs)", False, " || ".join(warned))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_lodger":
        stats_path, rest = sys.argv[2], sys.argv[3:]
        wrapped_lodger(stats_path, rest[1:] if rest[:1] == ["--"] else rest)
    else:
        sys.exit(main(sys.argv[1:]))
