"""Measurements of this machine and of real training steps, for the estimator (memory/estimate.py): the
resident size of the training runtime, the memory available, and a few real steps of a job in a
fresh process with their peak resident memory (``measure``). No torch at import.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import LodgerError

if TYPE_CHECKING:
    from ..config import JobConfig

# Whether `lodger run` pins the mmap threshold (pin_allocator): it does not; slower steps (docs/memory.md).
RUNS_PIN_ALLOCATOR = False


def _proc_status(key: str) -> int:
    """A /proc/self/status value (VmRSS, VmHWM, ...) in bytes; 0 where there is no /proc."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def pin_allocator(threshold: int = 64 * 1024) -> bool:
    """Fix glibc's mmap threshold, so every block of ``threshold`` bytes or more is its own mapping,
    returned to the system the moment it is freed: the resident set then follows the live tensors
    instead of keeping what earlier steps freed (SmolLM2: 10-18 % less peak), at the price of
    page faults on every new tensor (steps up to 50 % slower when they take about a second).
    Call it once, as early as possible. Returns False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False


def memory_available() -> int:
    """MemAvailable from /proc/meminfo (bytes), or psutil's figure elsewhere."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(psutil.virtual_memory().available)


_RUNTIME_PROBE = r"""
import sys, torch, transformers, peft
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from peft import LoraConfig, get_peft_model
torch.set_num_threads(int(sys.argv[1]))
# One small training step loads the kernels' code and starts the thread pool, as a real run does.
layer = torch.nn.Linear(64, 64)
opt = torch.optim.AdamW(layer.parameters(), fused=True)
x = torch.randn(2, 4, 16, 64)
y = torch.nn.functional.scaled_dot_product_attention(x, x, layer(x), attn_mask=torch.ones(16, 16, dtype=torch.bool))
torch.nn.functional.cross_entropy(y.reshape(-1, 64), torch.zeros(128, dtype=torch.long)).backward()
opt.step()
with open("/proc/self/status") as fh:
    print([int(l.split()[1]) * 1024 for l in fh if l.startswith("VmRSS:")][0])
"""


def _runtime_key(threads: int) -> str:
    from importlib.metadata import version

    from .. import __version__

    from ..quant import library_version  # peft imports bitsandbytes when it is installed: part of the runtime

    parts = [sys.version, str(threads)] + [version(p) for p in ("torch", "transformers", "peft")] + [__version__]
    parts += [f"bitsandbytes {library_version()}"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def runtime_bytes(*, threads: int | None = None, use_current: bool = True) -> int:
    """Resident size of a process that has imported torch, transformers and peft.

    Measured in this process when it has imported all three (``use_current``), else once in a
    fresh subprocess and cached under $LODGER_HOME/cache/runtime/ by library versions."""
    if use_current and all(m in sys.modules for m in ("torch", "transformers", "peft")):
        rss = _proc_status("VmRSS")
        if rss:
            return rss
    from .. import durable
    from ..home import cache_dir

    threads = threads or len(os.sched_getaffinity(0))
    memo = cache_dir("runtime") / f"{_runtime_key(threads)}.json"
    if memo.is_file():
        try:
            return int(json.loads(memo.read_text())["rss_bytes"])
        except (ValueError, KeyError):
            memo.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _RUNTIME_PROBE, str(threads)], capture_output=True,
                          text=True, env=env, timeout=300)
    if done.returncode != 0:
        raise LodgerError(f"could not measure the size of the training runtime: "
                          f"{done.stderr.strip().splitlines()[-1:] or done.returncode}")
    rss = int(done.stdout.split()[-1])
    durable.atomic_write(memo, json.dumps({"rss_bytes": rss, "threads": threads}).encode())
    return rss


# -- measuring real steps -----------------------------------------------------------------------
@dataclass
class Measurement:
    """Peak resident memory of a few real training steps, measured in a fresh process."""

    peak_bytes: int                 # VmHWM at the end (the steps, then a checkpoint's bytes)
    import_bytes: int               # VmRSS after the imports
    step_peaks: list[int]           # VmHWM after each step
    step_seconds: list[float]
    phases: dict[str, int]          # VmRSS after each phase


def measure(job: "JobConfig", folder: Path, *, seq_len: int | None = None, steps: int = 2,
            timeout: float | None = None, pinned_allocator: bool | None = None, packed: bool = False) -> Measurement:
    """Run ``steps`` real optimizer steps of ``job`` at its shape (batch_size x seq_len synthetic
    tokens, one row padded) in a fresh process, as `lodger run` does them, and measure its peak RSS.

    ``pinned_allocator`` (default RUNS_PIN_ALLOCATOR) calls pin_allocator() first, as such a run would.
    ``packed``: rows of two examples each, as packing.collate_packed makes them (no attention_mask)."""
    pinned = RUNS_PIN_ALLOCATOR if pinned_allocator is None else pinned_allocator
    spec = {"job": job.model_dump(mode="json"), "folder": str(folder),
            "seq_len": int(seq_len or job.data.max_length), "steps": steps, "pinned": pinned, "packed": packed}
    threads = job.training.threads or len(os.sched_getaffinity(0))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        done = subprocess.run([sys.executable, "-c", "from lodger.memory.measure import measure_child; measure_child()"],
                              input=json.dumps(spec), capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LodgerError(f"the measurement did not finish within {timeout:.0f} s") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("MEASURED ")]
    if done.returncode != 0 or not lines:
        why = "killed (out of memory?)" if done.returncode in (-9, 137) else f"exit code {done.returncode}"
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise LodgerError(f"the measurement process failed ({why}):\n{tail}")
    return Measurement(**json.loads(lines[-1].removeprefix("MEASURED ")))


def measure_child() -> None:
    """Body of the measuring process: the pieces of `lodger run`, a few steps, VmHWM."""
    spec = json.loads(sys.stdin.read())
    if spec.get("pinned"):
        pin_allocator()
    import torch

    from ..config import JobConfig
    from ..model import attach_method, load_base_model, load_tokenizer
    from ..train.optim import build_optimizer
    from ..train.precision import Precision
    from ..train.objective import make_objective
    from ..train.step import micro_step, optimizer_step

    job = JobConfig.model_validate(spec["job"])
    cfg = job.training
    torch.set_num_threads(cfg.threads or len(os.sched_getaffinity(0)))
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(cfg.seed)
    phases = {"imports": _proc_status("VmRSS")}
    import_bytes = phases["imports"]
    tokenizer = load_tokenizer(Path(spec["folder"]))
    phases["tokenizer"] = _proc_status("VmRSS")
    model = attach_method(load_base_model(Path(spec["folder"]), job.method, "cpu", cfg.precision), job.method, cfg.seed)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if job.method.kind == "lora":
            model.enable_input_require_grads()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg)
    phases["model"] = _proc_status("VmRSS")
    batch_size, seq = cfg.batch_size, spec["seq_len"]
    generator = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(3, len(tokenizer), (batch_size, seq), generator=generator)
    attention = torch.ones(batch_size, seq, dtype=torch.long)
    attention[-1, seq - max(1, seq // 4):] = 0  # real batches are padded: SDPA then keeps a mask
    batch = {"input_ids": ids, "attention_mask": attention,
             "labels": torch.where(attention.bool(), ids, torch.tensor(-100))}
    if spec.get("packed"):  # two examples per row, positions restarting, attention per example as a run has it
        from ..train.attention import set_attention

        set_attention(model)
        half = max(1, seq // 2)
        positions = (torch.arange(seq) % half).expand(batch_size, seq).clone()
        batch = {"input_ids": ids, "position_ids": positions,
                 "labels": torch.where(positions == 0, torch.tensor(-100), ids)}
    # The CPU estimate: bf16 autocast stands in for every half precision (fp16 needs a GPU).
    precision = Precision("fp32" if cfg.precision == "fp32" else "bf16", "cpu")
    if job.method.objective == "grpo":  # completions sampled, scored and trained on, as a run does
        objective, prompts = _grpo_objective(job, model, tokenizer, precision, seq, generator)
    else:
        objective = make_objective(job.method)
    weights = (max(int((batch["labels"] != -100).sum()) * cfg.grad_accum, 1),)
    if objective.name in ("dpo", "orpo", "kto"):  # pairs (or KTO lines) laid out by the training collate itself
        batch, weights = _preference_batch(job, objective, len(tokenizer), seq, bool(spec.get("packed")), generator)
    model.train()
    step_peaks, step_seconds = [], []
    for step in range(spec["steps"]):  # the loop's own step functions (train/step.py)
        started = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float32)
        if objective.name == "grpo":
            rollouts = objective.prepare(model, prompts, step, 0)
            weights = objective.weights(None, [])
        for k in range(cfg.grad_accum):
            if objective.name == "grpo":
                batch = rollouts[k]
            loss_sum += micro_step(objective, model, batch, precision, "cpu", weights)[0]
        optimizer_step(params, optimizer, precision, cfg.max_grad_norm or math.inf, loss_sum)
        step_seconds.append(time.perf_counter() - started)
        step_peaks.append(_proc_status("VmHWM"))
        phases[f"step{len(step_peaks)}"] = _proc_status("VmRSS")
    phases["file"] = _proc_status("RssFile")
    phases["checkpoint_bytes"] = _write_checkpoint(model, job, optimizer)
    phases["after_checkpoint"] = _proc_status("VmHWM")
    print("MEASURED " + json.dumps({"peak_bytes": _proc_status("VmHWM"), "import_bytes": import_bytes,
                                    "step_peaks": step_peaks, "step_seconds": step_seconds,
                                    "phases": phases}), flush=True)


def _write_checkpoint(model, job: "JobConfig", optimizer) -> int:
    """Bytes of a checkpoint written as train/checkpointer.py writes it (streamed from the tensors'
    memory), in a scratch folder removed afterwards."""
    import tempfile

    from ..checkpoint import CheckpointStore
    from ..model import adapter_files
    from ..train.optim import optimizer_files

    with tempfile.TemporaryDirectory(prefix="lodger-measure-") as scratch:
        saved = CheckpointStore(Path(scratch) / "checkpoints", keep_last=2).save(
            1, {**adapter_files(model, job.method), **optimizer_files(optimizer)})
        return sum(f.stat().st_size for f in saved.iterdir())


def _grpo_objective(job: "JobConfig", model, tokenizer, precision, seq: int, generator):
    """GRPO's objective on ``grad_accum`` micro-batches of ``batch_size`` synthetic ``seq``-token
    prompts, every completion sampled to max_completion_length (the widest a step gets), rewards
    drawn at random (the reward host's memory is its own process's)."""
    import dataclasses

    import torch

    from ..data.prompts import PromptBatch, PromptSet
    from ..train.grpo import GRPO

    cfg, grpo = job.training, job.grpo
    n = cfg.batch_size * cfg.grad_accum
    ids = torch.randint(3, len(tokenizer), (n, seq), generator=generator)
    rows = [{"prompt": "x", "line": k + 1} for k in range(n)]
    prompts = PromptSet({"ids": ids.reshape(-1), "offsets": torch.arange(0, n * seq + 1, seq), "lines": torch.arange(n)},
                        rows)

    class Rewards:  # stands in for the reward host: one random reward per completion
        labels, weights = ["random"], [1.0]

        def score(self, prompts, completions, *rest, **keys):
            return torch.rand(len(completions), 1, generator=generator).tolist()

    sync = type("Sync", (), {"sum_across": staticmethod(lambda values: values)})()
    progress = type("Progress", (), {"step": 0})()
    reference = None
    if grpo.beta > 0 and job.method.kind == "full":
        import copy

        reference = copy.deepcopy(model).eval().requires_grad_(False)
    objective = GRPO(grpo, Rewards(), tokenizer=tokenizer, dataset=prompts, eval_set=None, precision=precision,
                     device="cpu", sync=sync, progress=progress, reference=reference)
    objective.sampling = dataclasses.replace(objective.sampling, min_new=grpo.max_completion_length)  # full length
    batches = [PromptBatch(list(range(m * cfg.batch_size, (m + 1) * cfg.batch_size))) for m in range(cfg.grad_accum)]
    return objective, batches


def _preference_batch(job: "JobConfig", objective, vocab: int, seq: int, packed: bool, generator):
    """A micro-batch of ``batch_size`` synthetic examples of ``seq``-token sequences (a quarter
    prompt; the last sequence a quarter shorter, so padded batches have padding), collated as
    training collates them, and the step's normalisers for ``grad_accum`` such micro-batches."""
    import torch

    from ..data.preference import PreferenceSet, flatten

    n, per = job.training.batch_size, objective.sequences
    examples = []
    for k in range(n):
        sequences = []
        for s in range(per):
            length = seq - seq // 4 if (k, s) == (n - 1, per - 1) else seq
            ids = torch.randint(3, vocab, (length,), generator=generator).tolist()
            sequences.append((ids, [0] * (length // 4) + [1] * (length - length // 4)))
        examples.append(sequences)
    tensors = {**flatten(examples), "lines": torch.arange(n)}
    if objective.name == "kto":  # its KL sequences, and alternating labels
        tensors["labels"] = torch.arange(n) % 2 == 0
        tensors.update({f"kl_{k}": v for k, v in flatten([[e[0]] for e in examples]).items() if k != "splits"})
    dataset = PreferenceSet(objective.name, tensors)
    dataset.reference = torch.zeros((n, 2))
    layout = [tuple(range(n))] if packed else [(i,) for i in range(n)]
    batch = dataset.collate(layout, 0, packed=packed, segments=packed)
    weights = tuple(w * job.training.grad_accum for w in objective.weights(dataset, list(range(n))))
    return batch, weights
