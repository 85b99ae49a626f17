#!/usr/bin/env python3
"""One-shot check of a quantised base's CUDA paths ([method] base_bits; docs/qlora.md), through the
real `lodger` command, with scripts/gpu_check.py's machinery (its Checker, memory and resume
checks): a 4-bit LoRA run in bf16 (bf16 compute on the 4-bit base), its pre-flight memory estimate
against torch.cuda's peaks, the same run again compared bitwise, a run killed with SIGKILL after a
checkpoint and resumed compared bitwise; a 4-bit DoRA run and an 8-bit fp32 run with their estimates.
Writes $OUT/gpu_check.txt (the summary) and $OUT/gpu_check_log.txt.

    scripts/gpu_qlora_check.sh            # on the GPU machine (OUT set by the device tool)
    scripts/gpu_qlora_check.sh --cpu      # test this script on a CPU (tiny model)

The GPU image lacks bitsandbytes: put its wheel (bitsandbytes-0.50.2, 43 MB, CUDA kernels inside)
into the git-ignored .whl/ with the others gpu_check.sh installs, and carry .whl.

Sized for the device tool's short loans: about 3 minutes on an H100 (a 90M-parameter random Llama,
512-token examples, 20 steps).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

import gpu_check as g  # noqa: E402  (its Checker, write_job, long_text_jsonl, check_memory, kill_and_resume)


def jobs(c: g.Checker) -> dict[str, Path]:
    from fixtures_lib import build_tiny_model

    if c.cpu:
        model = build_tiny_model(c.work / "model", seed=0, hidden=64, intermediate=128)
        shape = dict(steps=8, batch_size=4, max_length=64, every=4, per_line=3)
    else:
        model = build_tiny_model(c.work / "model", seed=0, hidden=1024, layers=8, heads=16, kv_heads=4,
                                 intermediate=2816)
        shape = dict(steps=20, batch_size=8, max_length=512, every=5, per_line=32)
    train = g.long_text_jsonl(c.work / "data" / "train.jsonl", 64, 0, shape["per_line"])
    found = {}
    for label, method, precision in (("4bit-bf16", {"base_bits": 4}, "bf16"),
                                     ("4bit-dora-bf16", {"base_bits": 4, "use_dora": True}, "bf16"),
                                     ("8bit-fp32", {"base_bits": 8}, "fp32")):
        sections = {
            "model": {"source": str(model)},
            "method": {"kind": "lora", "rank": 8, "alpha": 16.0, "dropout": 0.1, **method,
                       "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
            "data": {"train": str(train), "eval_fraction": 0.0, "max_length": shape["max_length"]},
            "training": {"steps": shape["steps"], "batch_size": shape["batch_size"], "grad_accum": 2,
                         "learning_rate": 2e-3, "seed": 0, "threads": 1 if c.cpu else 4,
                         "device": "cpu" if c.cpu else "cuda", "precision": "fp32" if c.cpu else precision},
            "checkpoints": {"every_steps": shape["every"], "keep_last": 20},
        }
        found[label] = g.write_job(c.work / f"job-{label}.toml", sections)
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU with a tiny model (script test)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_qlora_out")
    parser.add_argument("--work", default="/tmp/gpu_qlora_work")
    parser.add_argument("--budget", type=float, default=400.0, help="seconds for all checks together")
    args = parser.parse_args(argv)
    c = g.Checker(args)
    r = c.report
    r.line(f"lodger QLoRA GPU check ({'CPU test mode' if c.cpu else 'CUDA'}), {time.strftime('%Y-%m-%d %H:%M:%S')}")
    try:
        g.environment(c)
        from lodger.quant import device_problem, library_version

        device = "cpu" if c.cpu else "cuda"
        problem = device_problem(4, device)
        r.result("bitsandbytes serves the device", problem is None, f"bitsandbytes {library_version()} on {device}: "
                 f"{problem or 'kernels found'}")
        found = jobs(c)
        first = c.train("4bit-bf16", found["4bit-bf16"])
        if first:
            g.check_memory(c, "4bit-bf16", first)
            again = c.train("4bit-bf16 again", found["4bit-bf16"])
            if again:
                g.compare_runs(c, "determinism 4bit-bf16: two runs", first, again)
            g.kill_and_resume(c, "resume 4bit-bf16", found["4bit-bf16"], first)
        for label in ("4bit-dora-bf16", "8bit-fp32"):
            run = c.train(label, found[label])
            if run:
                g.check_memory(c, label, run)
    except Exception as exc:  # the summary must still say what happened
        import traceback

        r.result("script", False, f"{type(exc).__name__}: {exc}")
        r.append_log("script exception", traceback.format_exc())
    r.line(f"RESULT: {len(r.passed)} passed, {len(r.failed)} failed ({', '.join(r.failed) or '-'}), "
           f"{len(r.skipped)} skipped; {c.calls} lodger calls; {c.left():.0f} s of budget left")
    return 1 if r.failed else 0


if __name__ == "__main__":  # each lodger call goes through gpu_check.py's own `_lodger` wrapper
    sys.exit(main(sys.argv[1:]))
