"""lodger's GRPO against TRL's ``GRPOTrainer`` on the same LoRA job: steps per second and peak RSS.

Each side runs in its own child process (one after the other, alternating when repeated); peak
RSS is that child's ``ru_maxrss`` from ``os.wait4``. The job: SmolLM2-135M-Instruct, LoRA r=8 on
q/v, the bundled arithmetic prompts (``src/lodger/demo/grpo.jsonl``, conversational) scored by
the bundled verifier (``src/lodger/demo/verifier.py``, the same function on both sides), 4
prompts x G = 4 completions per step (TRL: ``per_device_train_batch_size`` 16 completions,
``num_generations`` 4, one generation per step), max_completion_length 16, temperature 1.0,
loss "dapo", beta 0 (no reference pass), learning rate 1e-3, cosine to 10 %, clip 1.0, 2 threads,
seed 0, fp32. The same prompts in the same order on both sides: TRL gets the rows pre-ordered by
lodger's sampler and a sequential sampler (each prompt repeated G times by TRL's own sampler).

TRL runs with its defaults but for those that change the job: bf16 and gradient checkpointing
(TRL 1.16 turns both on, even on the CPU) are off, as in lodger's fp32 job, and TRL's eval and
saving are off (lodger checkpoints every 50 steps as a user's job does). Steps per second: from
the end of step 1 to the end of the last step on both sides (lodger's metrics.jsonl stamps, a
callback's for TRL); the process wall-time ratio includes everything. The completions differ
(each side draws its own), so only the speed, the memory and the reward's scale are comparable.

    python bench/grpo_compare.py            # 20 steps, one run each
    python bench/grpo_compare.py --quick    # 10 steps
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

DEMO = common.ROOT / "src" / "lodger" / "demo"
PROMPTS, VERIFIER = DEMO / "grpo.jsonl", DEMO / "verifier.py"
G, LENGTH, LR = 4, 16, 1e-3


def write_job(folder: Path, steps: int, every: int) -> Path:
    path = folder / "grpo-bench.toml"
    path.write_text(f"""name = "grpo-bench"
[model]
source = "{common.MODEL_ALIAS}"
[method]
kind = "lora"
rank = {common.RANK}
alpha = {common.ALPHA}
target_modules = {json.dumps(list(common.TARGETS))}
objective = "grpo"
[data]
train = "{PROMPTS}"
eval_fraction = 0.0
max_length = 64
[training]
steps = {steps}
batch_size = {common.BATCH}
learning_rate = {LR}
min_lr_ratio = {common.MIN_LR_RATIO}
seed = {common.SEED}
threads = {common.THREADS}
log_every = 1000000
[checkpoints]
every_steps = {every}
keep_last = 3
[limits]
nice = 0
[grpo]
num_generations = {G}
max_completion_length = {LENGTH}
loss_type = "dapo"
[[rewards]]
kind = "python"
file = "{VERIFIER}"
function = "right_number"
""")
    return path


def trl_child(steps: int, out: Path) -> None:
    import importlib.util

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lodger.model import model_folder, quiet_transformers, resolve_source

    quiet_transformers()
    torch.set_num_threads(common.THREADS)
    spec = importlib.util.spec_from_file_location("verifier", VERIFIER)
    verifier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(verifier)
    folder = model_folder(resolve_source(common.MODEL_ALIAS))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    ordered = [rows[i] for batch in common.batch_order(len(rows), steps) for i in batch]
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
    ends: list[float] = []
    rewards: list[float] = []

    class Stamps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    with tempfile.TemporaryDirectory(dir=common.bench_home()) as tmp:
        args = GRPOConfig(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=common.BATCH * G, num_generations=G,
            max_completion_length=LENGTH, temperature=1.0, beta=0.0, loss_type="dapo", learning_rate=LR,
            lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": common.MIN_LR_RATIO},
            warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, save_strategy="no", report_to="none", use_cpu=True,
            logging_steps=1, shuffle_dataset=False, dataloader_num_workers=0, dataloader_pin_memory=False,
            disable_tqdm=True, seed=common.SEED, bf16=False, gradient_checkpointing=False)
        peft = LoraConfig(r=common.RANK, lora_alpha=common.ALPHA, lora_dropout=0.0, target_modules=list(common.TARGETS),
                          bias="none", task_type="CAUSAL_LM")
        trainer = GRPOTrainer(model=model, reward_funcs=[verifier.right_number], args=args,
                              train_dataset=Dataset.from_list(ordered), processing_class=tokenizer, peft_config=peft,
                              callbacks=[Stamps()])
        trainer.train()
    out.write_text(json.dumps({"ends": ends, "rewards": rewards, "optim": args.optim}))


def main() -> None:
    args = common.side_by_side_args(__doc__, "--child-trl")
    if args.child:
        trl_child(args.steps, args.out)
        return
    if args.steps == 100:  # side_by_side_args' default is the SFT benches'; GRPO steps are long
        args.steps = 20
    if args.quick:
        args.steps = 10
    import tempfile as tf

    jobs = Path(tf.mkdtemp(prefix="jobs-", dir=common.bench_home()))
    job = write_job(jobs, args.steps, args.every)
    warm = common.warm_caches(job)
    print(f"# GRPO, {args.steps} steps, {common.BATCH} prompts x {G} completions of up to {LENGTH} tokens, "
          f"{common.THREADS} threads, lodger checkpoints every {args.every}, TRL saves nothing; caches ready "
          f"({warm['seconds']:.1f} s, untimed); load average at start {os.getloadavg()[0]:.2f}", flush=True)

    def report(side, result):
        result.extra["sps"] = common.steady_steps_per_s(result.extra["ends"])
        if side == "lodger":
            records = [json.loads(line) for line in (Path(result.extra["folder"]) / "metrics.jsonl").read_text()
                       .splitlines() if line.strip()]
            result.extra["rewards"] = [r["reward"] for r in records if r["kind"] == "train"]
        print(f"# {side}: {result.extra['sps']:.3f} steps/s, wall {result.wall:.1f} s, cpu {result.cpu:.1f} s, "
              f"peak rss {common.gib(result.peak_rss)}, load {os.getloadavg()[0]:.2f}", flush=True)

    runs = common.alternate(job, __file__, "--child-trl", "trl", args, report)
    ls = common.median([r.extra["sps"] for r in runs["lodger"]])
    ts = common.median([r.extra["sps"] for r in runs["trl"]])
    lr = common.median([r.peak_rss for r in runs["lodger"]])
    tr = common.median([r.peak_rss for r in runs["trl"]])
    lw = common.median([r.wall for r in runs["lodger"]])
    tw = common.median([r.wall for r in runs["trl"]])
    mean = lambda values: sum(values) / max(len(values), 1)  # noqa: E731
    lrw, trw = runs["lodger"][0].extra["rewards"], runs["trl"][0].extra["rewards"]
    print(f"grpo: lodger/TRL steps-per-second ratio {ls / ts:.2f} (lodger {ls:.3f}, TRL {ts:.3f} steps/s, end of "
          f"step 1 to end of step {args.steps}; goal >= 1.0)")
    print(f"grpo: lodger/TRL peak-RSS ratio {lr / tr:.2f} (lodger {common.gib(lr)}, TRL {common.gib(tr)}; goal <= 1.0)")
    print(f"grpo: lodger/TRL process wall-time ratio {lw / tw:.2f} (lodger {lw:.1f} s, TRL {tw:.1f} s; everything "
          "included)")
    print(f"grpo: mean reward over the steps lodger {mean(lrw):.3f}, TRL {mean(trw):.3f} (each side samples its own "
          f"completions); TRL optimizer {runs['trl'][0].extra['optim']}")
    print(f"# load average at end {os.getloadavg()[0]:.2f} (the machine has {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
