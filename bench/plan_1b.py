"""The planner on a model of about a billion parameters: `lodger plan` against a few measured steps.

A synthetic Llama (hidden 2048, 16 layers, 32 heads, 8 key-value heads, MLP 8192: 0.97 B
parameters with the tests' small tokenizer) is built once, randomly initialised by
tests/fixtures_lib.build_tiny_model (nothing downloaded; about 3.9 GB of fp32 safetensors in the
scratch folder). `lodger plan JOB --memory M --json` (the real command) picks the settings for a
LoRA job (r=8 on q/v, batch 4 x 256, 2 threads); the chosen job then runs 3 real steps in a fresh
process (`lodger.memory.estimate.measure`: lodger's own pieces, VmHWM), and the lines compare the
planner's predicted peak and time per step with what was measured.

    python bench/plan_1b.py                        # --memory 5GiB: fp32 and 8 bits do not fit, 4 bits does
    python bench/plan_1b.py --memory 3GiB --scratch /var/tmp/lodger-1b   # a smaller micro-batch

Result lines: `plan 1b: predicted peak 2.71 GiB, measured 2.60 GiB, ratio 1.04` (goal 0.9-1.1) and
`plan 1b: predicted 31.0 s/step, measured 28.2 s/step (steps 2-3), ratio 1.10`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import common  # noqa: E402

GiB = 2**30
SHAPE = {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "intermediate": 8192}


def build(scratch: Path) -> Path:
    from fixtures_lib import build_tiny_model, make_text_records

    folder = scratch / "llama-1b"
    if not (folder / "model.safetensors").is_file():
        started = time.perf_counter()
        build_tiny_model(folder, seed=0, **SHAPE)
        print(f"# built {folder} in {time.perf_counter() - started:.0f} s", flush=True)
    # Examples longer than max_length, so that every row the planner counts is as wide as the
    # measured ones (measure() pads every row to seq_len; short chats would be planned narrower).
    records = make_text_records(64 * 24, 0)
    with (scratch / "train.jsonl").open("w") as fh:
        for i in range(64):
            fh.write(json.dumps({"text": "\n".join(r["text"] for r in records[i * 24:(i + 1) * 24])}) + "\n")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory", default="5GiB")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/lodger-bench-1b"))
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    common.use_bench_home()
    args.scratch.mkdir(parents=True, exist_ok=True)
    folder = build(args.scratch)
    job_path = args.scratch / "job.toml"
    job_path.write_text(f'name = "plan-1b"\n[model]\nsource = "{folder}"\n[method]\nkind = "lora"\nrank = {common.RANK}\n'
                        f'alpha = {common.ALPHA}\n[data]\ntrain = "train.jsonl"\neval_fraction = 0.0\n'
                        f'max_length = {args.seq}\n[training]\nsteps = 3\nbatch_size = {common.BATCH}\n'
                        f'threads = {common.THREADS}\npacking = false\n')
    lodger = Path(sys.executable).with_name("lodger")
    out = args.scratch / "job-plan.toml"
    done = subprocess.run([str(lodger), "plan", str(job_path), "--memory", args.memory, "--out", str(out), "--json"],
                          capture_output=True, text=True, env=common.child_env())
    if done.returncode != 0:
        sys.exit(f"lodger plan failed ({done.returncode}): {done.stderr[-2000:]}")
    planned = json.loads(done.stdout)
    chosen = [o for o in planned["options"] if o["fits"]][planned["chosen"] - 1]
    print(f"# plan within {args.memory}: {chosen['setting']} (of {len(planned['options'])} considered, "
          f"{sum(o['fits'] for o in planned['options'])} fit); items (MiB) "
          + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in chosen["items"].items()), flush=True)
    from lodger.memory import estimate as memory
    from lodger.lifecycle.jobfile import load_job

    job = load_job(out)
    seq = min(args.seq, job.data.max_length)
    got = memory.measure(job, folder, seq_len=seq, steps=3)
    print(f"# planned width {chosen.get('seq_len', '?')}, measured rows {seq} wide; measured phases (MiB) "
          + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in got.phases.items())
          + f"; s/step {', '.join(f'{s:.1f}' for s in got.step_seconds)}; load average {os.getloadavg()[0]:.1f}",
          flush=True)
    peak = chosen["peak_bytes"]
    print(f"plan 1b: predicted peak {peak / GiB:.2f} GiB, measured {got.peak_bytes / GiB:.2f} GiB, "
          f"ratio {peak / got.peak_bytes:.2f}")
    steady = sum(got.step_seconds[1:]) / len(got.step_seconds[1:])
    print(f"plan 1b: predicted {chosen['step_seconds']:.1f} s/step, measured {steady:.1f} s/step (steps 2-3), "
          f"ratio {chosen['step_seconds'] / steady:.2f}")


if __name__ == "__main__":
    main()
