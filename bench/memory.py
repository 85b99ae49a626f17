"""How close `lodger estimate` comes to the measured peak memory of real training steps.

For SmolLM2-135M (the cached dequantised folder of `smollm2-135m-instruct`): LoRA r=8 on
q/v and full fine-tuning, two sequence lengths, with and without gradient checkpointing, fp32,
2 threads. Each measurement runs a few real steps of lodger's own pieces (load_base_model,
attach_method, build_optimizer, token_loss_sum, backward, AdamW) in a fresh process and reads
its VmHWM (`lodger.memory.estimate.measure`); the estimate uses the runtime size measured once in a fresh
process. Beside them: what `accelerate estimate-memory` reports for the same model, computed
from the local config.json with accelerate's own functions (the command itself needs the hub).

    python bench/memory.py                       # 8 measurements, batch 2, 3 steps each
    python bench/memory.py --quick               # LoRA and full at seq 128 without checkpointing
    python bench/memory.py --batch 4 --steps 2 --seqs 128 256 --jobs 1
    python bench/memory.py --quick --objective dpo   # pairs: two sequences per example

Result lines: `memory lora seq128 gc=off: estimate 1.23 GiB, measured 1.20 GiB, ratio 1.03`
(goal 0.9-1.1 each).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

GiB = 2**30


def make_job(kind: str, batch: int, seq: int, gc: bool, objective: str = "sft"):
    from lodger.config import JobConfig

    return JobConfig.model_validate({
        "model": {"source": common.MODEL_ALIAS},
        "method": {"kind": kind, "rank": common.RANK, "alpha": common.ALPHA, "target_modules": list(common.TARGETS),
                   "objective": objective},
        "data": {"train": "unused.jsonl", "max_length": seq},
        "training": {"steps": 3, "batch_size": batch, "threads": common.THREADS, "seed": common.SEED,
                     "gradient_checkpointing": gc}})


HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def accelerate_line(folder: Path) -> str:
    """What `accelerate estimate-memory` reports for this model (float32, training with Adam).

    The command needs the hub; offline, its own functions run on the local config.json instead."""
    try:
        from accelerate.commands.estimate import create_empty_model

        create_empty_model(HUB_ID, library_name="transformers")
        how = "the command's own model construction"
    except Exception as exc:  # offline: the hub look-up fails
        how = f"`accelerate estimate-memory {HUB_ID}` fails offline ({type(exc).__name__}: {exc}); its functions " \
              "on the local config.json instead"
    try:
        import torch
        from accelerate import init_empty_weights
        from accelerate.commands.estimate import estimate_training_usage
        from accelerate.utils import calculate_maximum_sizes
        from transformers import AutoConfig, AutoModel

        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        with init_empty_weights():  # what create_empty_model builds after its hub look-up
            model = AutoModel.from_config(config, dtype=torch.float32)
        total, largest = calculate_maximum_sizes(model)
        training = max(estimate_training_usage(total, "float32").values())
        return (f"accelerate estimate-memory: model {total / GiB:.2f} GiB, largest layer {largest[0] / GiB:.2f} "
                f"GiB, training with Adam (float32) {training / GiB:.2f} GiB for every row above: batch, sequence "
                f"length, LoRA and checkpointing are not inputs ({how})")
    except Exception as exc:  # report, do not fail the benchmark
        return f"accelerate estimate-memory: could not run offline either way ({type(exc).__name__}: {exc})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seqs", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--jobs", type=int, default=2, help="measurements running at once (memory is per process)")
    parser.add_argument("--quick", action="store_true", help="LoRA and full at the first sequence length, no checkpointing")
    parser.add_argument("--objective", default="sft", choices=["sft", "dpo", "orpo", "kto"],
                        help="a preference objective: each micro-batch holds batch pairs (docs/preference.md)")
    parser.add_argument("--pinned", action="store_true",
                        help="measure and estimate with glibc's mmap threshold pinned (memory.pin_allocator)")
    args = parser.parse_args()

    common.use_bench_home()
    from lodger.memory import estimate as memory
    from lodger.model import model_folder, resolve_source

    folder = model_folder(resolve_source(common.MODEL_ALIAS))
    config = json.loads((folder / "config.json").read_text())
    runtime = memory.runtime_bytes(threads=common.THREADS, use_current=False)
    cases = [(kind, seq, gc) for kind in ("lora", "full") for seq in args.seqs for gc in (False, True)]
    if args.quick:
        cases = [(kind, args.seqs[0], False) for kind in ("lora", "full")]
    load = os.getloadavg()[0]
    rate = memory.flops_per_second(common.THREADS)
    allocator = "pinned mmap threshold" if args.pinned else "glibc default allocator"
    print(f"# SmolLM2-135M, objective {args.objective}, batch {args.batch}, {args.steps} steps per measurement, "
          f"{common.THREADS} threads, "
          f"{allocator}, runtime {runtime / GiB:.2f} GiB, matmul {rate / 1e9:.0f} GFLOP/s, "
          f"load average {load:.1f}", flush=True)
    started = time.perf_counter()

    def one(case):
        kind, seq, gc = case
        job = make_job(kind, args.batch, seq, gc, args.objective)
        est = memory.estimate(job, config, runtime_bytes=runtime, flops_per_second=rate,
                              pinned_allocator=args.pinned)
        return case, est, memory.measure(job, folder, steps=args.steps, pinned_allocator=args.pinned)

    ratios = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for (kind, seq, gc), est, measured in pool.map(one, cases):
            ratio = est.total_bytes / measured.peak_bytes
            ratios.append(ratio)
            steps = ", ".join(f"{p / GiB:.2f}" for p in measured.step_peaks)
            seconds = min(measured.step_seconds[1:] or measured.step_seconds)
            print(f"# {kind} seq{seq} gc={'on' if gc else 'off'}: time estimate {est.step_seconds:.1f} s/step, "
                  f"measured {seconds:.1f} s/step (fastest after the first; two measurements share the cores)")
            print(f"# {kind} seq{seq} gc={'on' if gc else 'off'}: peak after each step {steps} GiB; estimate "
                  + ", ".join(f"{k} {v / GiB:.2f}" for k, v in est.items.items())
                  + (f", minus {est.overlap_bytes / GiB:.2f} not at once" if est.overlap_bytes else ""), flush=True)
            print(f"memory {kind} seq{seq} gc={'on' if gc else 'off'}: estimate {est.total_bytes / GiB:.2f} GiB, "
                  f"measured {measured.peak_bytes / GiB:.2f} GiB, ratio {ratio:.2f}", flush=True)
    inside = sum(0.9 <= r <= 1.1 for r in ratios)
    print(f"memory: {inside}/{len(ratios)} ratios within 0.9-1.1 (min {min(ratios):.2f}, max {max(ratios):.2f}; "
          f"goal all; {time.perf_counter() - started:.0f} s)")
    print(accelerate_line(folder))


if __name__ == "__main__":
    main()
