"""lodger against the Hugging Face ``Trainer`` on the same LoRA job: steps per second and peak RSS.

Each side runs in its own child process (one after the other, alternating when repeated); peak
RSS is that child's ``ru_maxrss`` from ``os.wait4``. The Trainer gets what makes it fast here
(its defaults: fused AdamW; ``use_cache=False``) and the same work as lodger: the same model folder,
the same tokenised examples in lodger's batch order (a sequential sampler over the examples
pre-ordered by lodger's sampler), padded by ``lodger.data.chats.collate``, the same cosine to 10 %
(``cosine_with_min_lr``, ``min_lr_rate=0.1``), clip at 1.0, a loss logged every step. It saves
nothing (``save_strategy="no"``); lodger commits a checkpoint every 50 steps, as a user's job would.

Steps per second are measured from the end of step 1 to the end of the last step on both sides
(lodger's per-step stamps in metrics.jsonl, a Trainer callback's stamps), so imports, model
loading and the first (warm-up) step are left out.

    python bench/trainer_compare.py            # 100 steps, one run each
    python bench/trainer_compare.py --quick    # 20 steps
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


def trainer_child(steps: int, out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    from lodger.data.chats import collate, read_jsonl, tokenize
    from lodger.model import model_folder, quiet_transformers, resolve_source, tokenizer_hash

    quiet_transformers()
    torch.set_num_threads(common.THREADS)
    folder = model_folder(resolve_source(common.MODEL_ALIAS))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    data = tokenize(read_jsonl(common.train_data()), tokenizer, tokenizer_hash(folder), common.MAX_LENGTH)
    model = common.lora_model(folder)
    ordered = [i for batch in common.batch_order(len(data), steps) for i in batch]

    class Examples(torch.utils.data.Dataset):
        def __len__(self):
            return len(ordered)

        def __getitem__(self, k):
            return {"index": ordered[k]}

    def collator(features):
        return collate(data, [f["index"] for f in features], tokenizer.pad_token_id)

    ends: list[float] = []
    losses: list[float] = []

    class Stamps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    with tempfile.TemporaryDirectory(dir=common.bench_home()) as tmp:
        args = TrainingArguments(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=common.BATCH,
            learning_rate=common.LR, lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": common.MIN_LR_RATIO}, warmup_steps=0, weight_decay=0.0,
            max_grad_norm=1.0, save_strategy="no", report_to="none", use_cpu=True, logging_steps=1,
            remove_unused_columns=False, train_sampling_strategy="sequential", dataloader_num_workers=0,
            dataloader_pin_memory=False, disable_tqdm=True, seed=common.SEED)
        trainer = Trainer(model=model, args=args, train_dataset=Examples(), data_collator=collator,
                          callbacks=[Stamps()])
        result = trainer.train()
    out.write_text(json.dumps({"ends": ends, "losses": losses, "optim": args.optim,
                               "train_runtime": result.metrics.get("train_runtime")}))


def main() -> None:
    args = common.side_by_side_args(__doc__, "--child-trainer")
    if args.child:
        trainer_child(args.steps, args.out)
        return
    job, warm = common.prepared_job(args.steps, args.every, "vs-trainer")
    print(f"# {args.steps} steps, batch {common.BATCH} x {common.MAX_LENGTH}, {common.THREADS} threads, "
          f"lodger checkpoints every {args.every}, Trainer saves nothing; caches ready "
          f"({warm['seconds']:.1f} s, untimed); load average at start {os.getloadavg()[0]:.2f}", flush=True)

    def report(side, result):
        result.extra["sps"] = common.steady_steps_per_s(result.extra["ends"])
        print(f"# {side}: {result.extra['sps']:.3f} steps/s, wall {result.wall:.1f} s, cpu {result.cpu:.1f} s, "
              f"peak rss {common.gib(result.peak_rss)}, load {os.getloadavg()[0]:.2f}", flush=True)

    runs = common.alternate(job, __file__, "--child-trainer", "trainer", args, report)

    ls = common.median([r.extra["sps"] for r in runs["lodger"]])
    ts = common.median([r.extra["sps"] for r in runs["trainer"]])
    lr = common.median([r.peak_rss for r in runs["lodger"]])
    tr = common.median([r.peak_rss for r in runs["trainer"]])
    lw = common.median([r.wall for r in runs["lodger"]])
    tw = common.median([r.wall for r in runs["trainer"]])
    ll, tl = runs["lodger"][0].extra["losses"], runs["trainer"][0].extra["losses"]
    print(f"trainer: lodger/Trainer steps-per-second ratio {ls / ts:.2f} (lodger {ls:.3f}, Trainer {ts:.3f} "
          f"steps/s, end of step 1 to end of step {args.steps}; goal >= 1.0)")
    print(f"trainer: lodger/Trainer peak-RSS ratio {lr / tr:.2f} (lodger {common.gib(lr)}, Trainer {common.gib(tr)}; "
          f"goal <= 1.0)")
    print(f"trainer: lodger/Trainer process wall-time ratio {lw / tw:.2f} (lodger {lw:.1f} s, Trainer {tw:.1f} s)")
    print(f"trainer: Trainer optimizer {runs['trainer'][0].extra['optim']}; losses max abs diff "
          f"{common.max_abs_diff(ll, tl):.2e} over {min(len(ll), len(tl))} steps")
    print(f"# load average at end {os.getloadavg()[0]:.2f} (the machine has {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
