#!/usr/bin/env python3
"""Train a fixed job on a tiny random Llama and print the sha256 of every checkpoint file it
commits: what a refactor must leave unchanged ("behaviour and checkpoint bytes stay the same").

    python scripts/checkpoint_digest.py OUT_DIR [--objective sft|dpo]

Run it on two commits (e.g. with PYTHONPATH pointing at each tree's src/) with the same OUT_DIR
(adapter_config.json names the model folder) and diff the outputs; MANIFEST.json is hashed
without its commit time.
Steps, eval losses and the final adapter's sha256 are printed too. Fixed: model (seed 0), data
(seed 0), job (12 steps, checkpoints every 4, LoRA dropout 0.1, grad_accum 2, 1 thread).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    objective = sys.argv[sys.argv.index("--objective") + 1] if "--objective" in sys.argv else "sft"
    from fixtures_lib import build_tiny_model, write_chat_jsonl, write_preference_jsonl

    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(out / "model", seed=0)
    if objective == "sft":
        train, evals = write_chat_jsonl(out / "train.jsonl", 64, 0), write_chat_jsonl(out / "eval.jsonl", 16, 1)
        method = ""
    else:
        train = write_preference_jsonl(out / "train.jsonl", 48, 0, objective)
        evals = write_preference_jsonl(out / "eval.jsonl", 8, 1, objective)
        method = f'objective = "{objective}"\n'
    job = out / "job.toml"
    job.write_text(f'name = "digest"\n[model]\nsource = "{model}"\n[method]\nkind = "lora"\nrank = 4\nalpha = 8.0\n'
                   f'dropout = 0.1\n{method}[data]\ntrain = "{train}"\neval = "{evals}"\nmax_length = 64\n'
                   '[training]\nsteps = 12\nbatch_size = 4\ngrad_accum = 2\nlearning_rate = 5e-3\nthreads = 1\n'
                   'eval_every = 4\n[checkpoints]\nevery_steps = 4\nkeep_last = 3\n')
    shutil.rmtree(out / "home", ignore_errors=True)  # one run per home: the digest is of this run
    env = {**os.environ, "LODGER_HOME": str(out / "home"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    lodger = Path(sys.executable).with_name("lodger")
    done = subprocess.run([str(lodger), "run", str(job), "--quiet"], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stderr)
    run = next((out / "home" / "runs").iterdir())
    for folder in sorted((run / "checkpoints").glob("step-*")):
        for f in sorted(folder.iterdir()):
            data = f.read_bytes()
            if f.name == "MANIFEST.json":  # its commit time (and the hash over it) differ every run
                manifest = {k: v for k, v in json.loads(data).items() if k not in ("created", "manifest_sha256")}
                data = json.dumps(manifest, sort_keys=True).encode()
            print(f"{folder.name}/{f.name} {hashlib.sha256(data).hexdigest()}")
    adapter = run / "adapter" / "adapter_model.safetensors"
    print(f"adapter {hashlib.sha256(adapter.read_bytes()).hexdigest()}")
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "eval":
            print(f"eval {r['step']} {r['eval_loss']!r}")


if __name__ == "__main__":
    main()
