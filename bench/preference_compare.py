"""lodger's DPO against TRL's ``DPOTrainer`` on the same LoRA job: steps per second and peak RSS.

Each side runs in its own child process (one after the other, alternating when repeated); peak
RSS is that child's ``ru_maxrss`` from ``os.wait4``. The job: SmolLM2-135M-Instruct, LoRA r=8 on
q/v, DPO with beta 0.1 on the bundled preference pairs (``src/lodger/demo/preference.jsonl``,
conversational, 96 pairs), 4 pairs per step, max_length 128, learning rate 5e-4, cosine to 10 %,
clip 1.0, 2 threads, seed 0. The same examples in the same order on both sides: TRL gets the rows
pre-ordered by lodger's sampler and a sequential sampler; the adapter starts from the same seed.

TRL runs with its defaults (``DPOConfig``: the reference is the base model with the adapter
disabled, computed live each step; padded batches; fused AdamW), given the adapter as a
``peft_config``, but for two that change the job: TRL 1.16 turns on bf16 autocast and gradient
checkpointing by default, even on the CPU; lodger's job is fp32 without recomputation, so TRL
runs fp32 without it too (the same arithmetic, so the losses can be compared; and the faster TRL
here). ``--trl-as-shipped`` runs TRL with those two defaults as well. lodger runs as a user's
job does (the reference log-probabilities computed once before step 1, "auto" packing, a
checkpoint every 50 steps). Steps per second: from the end of
step 1 to the end of the last step on both sides (lodger's metrics.jsonl stamps, a callback's
for TRL), so start-up and lodger's reference pass are left out of that ratio; the process
wall-time ratio includes everything (imports, model load, TRL's tokenisation, lodger's reference
pass, which every lodger side computes afresh, as a first run does, and its checkpoints).

    python bench/preference_compare.py            # 40 steps, one run each
    python bench/preference_compare.py --quick    # 20 steps
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

PAIRS = common.ROOT / "src" / "lodger" / "demo" / "preference.jsonl"
BETA, LR = 0.1, 5e-4


def write_job(folder: Path, steps: int, every: int) -> Path:
    path = folder / "dpo-bench.toml"
    path.write_text(f"""name = "dpo-bench"
[model]
source = "{common.MODEL_ALIAS}"
[method]
kind = "lora"
rank = {common.RANK}
alpha = {common.ALPHA}
target_modules = {json.dumps(list(common.TARGETS))}
objective = "dpo"
beta = {BETA}
[data]
train = "{PAIRS}"
eval_fraction = 0.0
max_length = {common.MAX_LENGTH}
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
""")
    return path


def trl_child(steps: int, out: Path, as_shipped: bool = False) -> None:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from lodger.model import model_folder, quiet_transformers, resolve_source

    quiet_transformers()
    torch.set_num_threads(common.THREADS)
    folder = model_folder(resolve_source(common.MODEL_ALIAS))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines() if line.strip()]
    ordered = [rows[i] for batch in common.batch_order(len(rows), steps) for i in batch]
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
    ends: list[float] = []
    losses: list[float] = []

    class Stamps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    with tempfile.TemporaryDirectory(dir=common.bench_home()) as tmp:
        args = DPOConfig(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=common.BATCH, beta=BETA,
            max_length=common.MAX_LENGTH, learning_rate=LR, lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": common.MIN_LR_RATIO}, warmup_steps=0, weight_decay=0.0,
            max_grad_norm=1.0, save_strategy="no", report_to="none", use_cpu=True, logging_steps=1,
            train_sampling_strategy="sequential", dataloader_num_workers=0, dataloader_pin_memory=False,
            disable_tqdm=True, seed=common.SEED, **({} if as_shipped else {"bf16": False,
                                                                           "gradient_checkpointing": False}))
        peft = LoraConfig(r=common.RANK, lora_alpha=common.ALPHA, lora_dropout=0.0, target_modules=list(common.TARGETS),
                          bias="none", task_type="CAUSAL_LM")
        trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(ordered),
                             processing_class=tokenizer, peft_config=peft, callbacks=[Stamps()])
        trainer.train()
    out.write_text(json.dumps({"ends": ends, "losses": losses, "optim": args.optim,
                               "precompute_ref_log_probs": args.precompute_ref_log_probs,
                               "padding_free": args.padding_free, "bf16": args.bf16,
                               "gradient_checkpointing": args.gradient_checkpointing}))


def main() -> None:
    shipped = "--trl-as-shipped" in sys.argv
    if shipped:
        sys.argv.remove("--trl-as-shipped")
    args = common.side_by_side_args(__doc__, "--child-trl")
    if args.child:
        trl_child(args.steps, args.out, as_shipped=shipped or bool(os.environ.get("LODGER_BENCH_TRL_AS_SHIPPED")))
        return
    if shipped:  # the flag reaches TRL's child through its environment
        os.environ["LODGER_BENCH_TRL_AS_SHIPPED"] = "1"
    if args.steps == 100:  # side_by_side_args' default is the SFT benches'; 40 DPO steps show the rate
        args.steps = 40
    import tempfile as tf

    jobs = Path(tf.mkdtemp(prefix="jobs-", dir=common.bench_home()))
    job = write_job(jobs, args.steps, args.every)
    warm = common.warm_caches(job)

    def forget_reference() -> None:
        import shutil

        shutil.rmtree(common.bench_home() / "cache" / "reference", ignore_errors=True)

    forget_reference()
    print(f"# DPO, {args.steps} steps, {common.BATCH} pairs x {common.MAX_LENGTH}, {common.THREADS} threads, "
          f"lodger checkpoints every {args.every}, TRL saves nothing; caches ready ({warm['seconds']:.1f} s, "
          f"untimed); load average at start {os.getloadavg()[0]:.2f}", flush=True)

    def report(side, result):
        forget_reference()  # every lodger side pays for its reference pass, as a first run does
        result.extra["sps"] = common.steady_steps_per_s(result.extra["ends"])
        print(f"# {side}: {result.extra['sps']:.3f} steps/s, wall {result.wall:.1f} s, cpu {result.cpu:.1f} s, "
              f"peak rss {common.gib(result.peak_rss)}, load {os.getloadavg()[0]:.2f}", flush=True)

    runs = common.alternate(job, __file__, "--child-trl", "trl", args, report)
    ls = common.median([r.extra["sps"] for r in runs["lodger"]])
    ts = common.median([r.extra["sps"] for r in runs["trl"]])
    lr = common.median([r.peak_rss for r in runs["lodger"]])
    tr = common.median([r.peak_rss for r in runs["trl"]])
    lw = common.median([r.wall for r in runs["lodger"]])
    tw = common.median([r.wall for r in runs["trl"]])
    ll, tl = runs["lodger"][0].extra["losses"], runs["trl"][0].extra["losses"]
    trl = runs["trl"][0].extra
    print(f"dpo: lodger/TRL steps-per-second ratio {ls / ts:.2f} (lodger {ls:.3f}, TRL {ts:.3f} steps/s, end of "
          f"step 1 to end of step {args.steps}; goal >= 1.0)")
    print(f"dpo: lodger/TRL peak-RSS ratio {lr / tr:.2f} (lodger {common.gib(lr)}, TRL {common.gib(tr)}; goal <= 1.0)")
    print(f"dpo: lodger/TRL process wall-time ratio {lw / tw:.2f} (lodger {lw:.1f} s, TRL {tw:.1f} s; everything "
          "included)")
    print(f"dpo: TRL optimizer {trl['optim']}, precompute_ref_log_probs {trl['precompute_ref_log_probs']}, "
          f"padding_free {trl['padding_free']}, bf16 {trl['bf16']}, gradient_checkpointing "
          f"{trl['gradient_checkpointing']}; losses max abs diff {common.max_abs_diff(ll, tl):.2e} over "
          f"{min(len(ll), len(tl))} steps")
    print(f"# load average at end {os.getloadavg()[0]:.2f} (the machine has {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
