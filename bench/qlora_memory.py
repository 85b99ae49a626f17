"""How close `lodger estimate` comes to the measured peak of a LoRA job on a quantised base.

For the tests' tiny Llama (tests/fixtures_lib.build_tiny_model, hidden 32, 2 layers) and for
SmolLM2-135M (the dequantised folder lodger caches for `smollm2-135m-instruct`, used as a plain
folder: its weights were Q4_1, dequantised, then quantised again here), LoRA r=8 on q/v, batch 4
x 128, 2 threads, with the base fp32, 4-bit and 8-bit, with and without DoRA. Each measurement is
a few real steps of lodger's own pieces in a fresh process (`lodger.memory.estimate.measure`, VmHWM).

    python bench/qlora_memory.py                   # both models, every case (about 15 min here)
    python bench/qlora_memory.py --models tiny --bits 4 8

Result lines: `memory smollm2 4-bit dora: estimate 1.52 GiB, measured 1.50 GiB, ratio 1.01` (goal 0.9-1.1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import common  # noqa: E402

GiB = 2**30


def make_job(folder: Path, bits: int | None, dora: bool, seq: int, batch: int, gc: bool = False):
    from lodger.config import JobConfig

    method = {"kind": "lora", "rank": common.RANK, "alpha": common.ALPHA, "target_modules": list(common.TARGETS)}
    if bits:
        method["base_bits"] = bits
    if dora:
        method["use_dora"] = True
    return JobConfig.model_validate({
        "model": {"source": str(folder)}, "method": method, "data": {"train": "unused.jsonl", "max_length": seq},
        "training": {"steps": 3, "batch_size": batch, "threads": common.THREADS, "seed": common.SEED,
                     "gradient_checkpointing": gc}})


def model_folders(names: list[str], scratch: Path) -> dict[str, Path]:
    from fixtures_lib import build_tiny_model

    from lodger.model import model_folder, resolve_source

    folders = {}
    if "tiny" in names:
        folders["tiny"] = build_tiny_model(scratch / "tiny", seed=0)
    if "smollm2" in names:
        folders["smollm2"] = model_folder(resolve_source(common.MODEL_ALIAS))
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--bits", nargs="+", type=int, default=[0, 4, 8], help="0: the fp32 base")
    parser.add_argument("--dora", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--seq", type=int, default=common.MAX_LENGTH)
    parser.add_argument("--batch", type=int, default=common.BATCH)
    parser.add_argument("--gc", action="store_true", help="gradient checkpointing")
    args = parser.parse_args()

    common.use_bench_home()
    from lodger.memory import estimate as memory

    runtime = memory.runtime_bytes(threads=common.THREADS, use_current=False)
    print(f"# batch {args.batch} x {args.seq}, LoRA r={common.RANK} on {'/'.join(common.TARGETS)}, "
          f"{common.THREADS} threads, runtime {runtime / GiB:.2f} GiB, load average {os.getloadavg()[0]:.1f}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="lodger-qlora-") as scratch:
        for name, folder in model_folders(args.models, Path(scratch)).items():
            config = json.loads((folder / "config.json").read_text())
            for bits in args.bits:
                for dora in [d for d in args.dora if not (d and bits == 8)]:  # refused: config/model.py
                    job = make_job(folder, bits or None, bool(dora), args.seq, args.batch, args.gc)
                    est = memory.estimate(job, config, runtime_bytes=runtime)
                    got = memory.measure(job, folder, steps=3)
                    label = f"{name} {f'{bits}-bit' if bits else 'fp32'}{' dora' if dora else ''}"
                    print(f"# {label}: items (MiB) " + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in est.items.items())
                          + "; measured phases (MiB) " + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in got.phases.items())
                          + f"; s/step {', '.join(f'{s:.2f}' for s in got.step_seconds)}", flush=True)
                    print(f"memory {label}: estimate {est.total_bytes / GiB:.3f} GiB, measured "
                          f"{got.peak_bytes / GiB:.3f} GiB, ratio {est.total_bytes / got.peak_bytes:.3f}", flush=True)


if __name__ == "__main__":
    main()
