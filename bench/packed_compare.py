"""Padding-free batches (issue 15): target tokens per second of lodger packed against the Hugging
Face ``Trainer``, and eval loss packed against unpacked after the same target tokens.

On a variable-length chat file made by ``make_chat_lengths.py`` (log-normal lengths up to the
limit), one epoch each, in child processes of this script, one after the other:

- ``lodger run`` with ``packing = true`` (rows of ``batch_size`` x ``max_length`` tokens) and with
  ``packing = false`` (right-padded batches of ``batch_size`` examples);
- the Trainer with its defaults (random sampler, batches of ``batch_size`` padded to their
  longest, by ``lodger.data.collate``);
- the Trainer with ``DataCollatorWithFlattening`` (its padding-free collator: each batch one row
  with restarting position ids), given as many examples per batch as a lodger packed step holds
  on average, so both update on the same amount of data per step;
- the Trainer with ``train_sampling_strategy="group_by_length"`` (batches of similar lengths).

Every side uses the same model folder, LoRA, learning rate schedule, threads and tokenised
examples (``lodger.data.tokenize``). Target tokens per second run from the end of step 1 to the
end of the last step (per-step stamps: lodger's metrics.jsonl, a Trainer callback), so start-up
and the first step are left out; a step's target tokens are its labelled positions.

    python bench/packed_compare.py            # 400 chats up to 256 tokens
    python bench/packed_compare.py --quick    # 32 chats up to 96 tokens: minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import make_chat_lengths  # noqa: E402

SIDES = ("defaults", "flattening", "group_by_length")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=400, help="training chats")
    parser.add_argument("--eval-lines", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--median", type=float, default=64.0, help="median chat length in tokens")
    parser.add_argument("--quick", action="store_true", help="32 chats up to 96 tokens, 8 eval chats")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=common.BATCH, help=argparse.SUPPRESS)
    parser.add_argument("--train", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick and not args.child:
        args.lines, args.eval_lines, args.max_length, args.median = 32, 8, 96, 32.0
    return args


def write_job(folder: Path, name: str, train: Path, eval_: Path, max_length: int, packing: bool) -> Path:
    path = folder / f"{name}.toml"
    path.write_text(f"""name = "{name}"
[model]
source = "{common.MODEL_ALIAS}"
[method]
kind = "lora"
rank = {common.RANK}
alpha = {common.ALPHA}
dropout = 0.0
target_modules = {json.dumps(list(common.TARGETS))}
[data]
train = "{train}"
eval = "{eval_}"
max_length = {max_length}
[training]
epochs = 1
batch_size = {common.BATCH}
learning_rate = {common.LR}
min_lr_ratio = {common.MIN_LR_RATIO}
seed = {common.SEED}
threads = {common.THREADS}
log_every = 1000000
packing = {"true" if packing else "false"}
[checkpoints]
keep_last = 2
""")
    return path


# -- the Trainer's side (a child process) ---------------------------------------------------------
def trainer_child(args) -> None:
    import torch
    from transformers import (AutoTokenizer, DataCollatorWithFlattening, Trainer,
                              TrainerCallback, TrainingArguments)

    from lodger.data import collate, read_jsonl, tokenize
    from lodger.model import model_folder, quiet_transformers, resolve_source, tokenizer_hash

    quiet_transformers()
    torch.set_num_threads(common.THREADS)
    folder = model_folder(resolve_source(common.MODEL_ALIAS))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    data = tokenize(read_jsonl(args.train), tokenizer, tokenizer_hash(folder), args.max_length)
    model = common.lora_model(folder)

    class Examples(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, k):
            ids, mask = data.example(k)
            return {"index": k, "input_ids": ids.tolist(),
                    "labels": torch.where(mask.bool(), ids, torch.tensor(-100)).tolist()}

    targets: list[int] = []  # per batch, in the order the data loader made them
    flatten = DataCollatorWithFlattening()

    def collator(features):
        if args.child == "flattening":
            batch = flatten([{"input_ids": f["input_ids"], "labels": f["labels"]} for f in features])
        else:
            batch = collate(data, [f["index"] for f in features], tokenizer.pad_token_id)
        targets.append(int((batch["labels"][:, 1:] != -100).sum()))
        return batch

    ends: list[float] = []

    class Stamps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.time())

    sampling = {"train_sampling_strategy": "group_by_length"} if args.child == "group_by_length" else {}
    with tempfile.TemporaryDirectory(dir=common.bench_home()) as tmp:
        targs = TrainingArguments(
            output_dir=tmp, num_train_epochs=1, per_device_train_batch_size=args.batch,
            learning_rate=common.LR, lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": common.MIN_LR_RATIO}, warmup_steps=0, weight_decay=0.0,
            max_grad_norm=1.0, save_strategy="no", report_to="none", use_cpu=True, logging_steps=1,
            remove_unused_columns=False, dataloader_num_workers=0, dataloader_pin_memory=False,
            disable_tqdm=True, seed=common.SEED, **sampling)
        Trainer(model=model, args=targs, train_dataset=Examples(), data_collator=collator,
                callbacks=[Stamps()]).train()
    args.out.write_text(json.dumps({"ends": ends, "targets": targets[:len(ends)]}))


# -- the parent ---------------------------------------------------------------------------------
def tokens_per_s(ends: list[float], targets: list[int]) -> float:
    """Target tokens of steps 2..N over the time from the end of step 1 to the end of step N."""
    return sum(targets[1:]) / (ends[-1] - ends[0])


def lodger_side(job: Path) -> dict:
    result = common.run_lodger(job)
    records = [json.loads(line) for line in (Path(result.extra["folder"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    computed = sum(r.get("computed", 0) for r in steps)
    padded = sum(r.get("padded", 0) for r in steps)
    return {"result": result, "tps": tokens_per_s([r["time"] for r in steps], [r["tokens"] for r in steps]),
            "steps": len(steps), "targets": sum(r["tokens"] for r in steps), "eval": evals[-1]["eval_loss"],
            "padding": padded / computed if computed else float("nan")}


def trainer_side(side: str, args, train: Path, batch: int) -> dict:
    out = common.bench_home() / f".packed-{side}-{os.getpid()}.json"
    argv = [sys.executable, __file__, "--child", side, "--batch", str(batch), "--train", str(train),
            "--max-length", str(args.max_length), "--out", str(out)]
    result = common.run_child(argv).check()
    report = json.loads(out.read_text())
    out.unlink()
    return {"result": result, "tps": tokens_per_s(report["ends"], report["targets"]), "steps": len(report["ends"]),
            "targets": sum(report["targets"]), "batch": batch}


def show(name: str, s: dict) -> None:
    r = s["result"]
    extra = f", padding {s['padding']:.2f}, eval loss {s['eval']:.4f}" if "eval" in s else f", batch {s['batch']}"
    print(f"# {name}: {s['tps']:.1f} target tokens/s, {s['steps']} steps, {s['targets']} target tokens"
          f"{extra}, wall {r.wall:.1f} s, peak rss {common.gib(r.peak_rss)}, load {os.getloadavg()[0]:.2f}",
          flush=True)


def main() -> None:
    args = parse_args()
    common.use_bench_home()
    if args.child:
        trainer_child(args)
        return
    jobs = Path(tempfile.mkdtemp(prefix="packed-", dir=common.bench_home()))
    train, eval_ = jobs / "train.jsonl", jobs / "eval.jsonl"
    lengths = make_chat_lengths.write(train, args.lines, args.max_length, args.median, 0.9, common.SEED)
    make_chat_lengths.write(eval_, args.eval_lines, args.max_length, args.median, 0.9, common.SEED + 1)
    packed_job = write_job(jobs, "packed", train, eval_, args.max_length, packing=True)
    unpacked_job = write_job(jobs, "unpacked", train, eval_, args.max_length, packing=False)
    warm = common.warm_caches(packed_job)
    print(make_chat_lengths.summary("planned tokens", lengths, args.max_length, common.BATCH))
    print(f"# {args.lines} chats (+{args.eval_lines} eval) up to {args.max_length} tokens, one epoch, batch "
          f"{common.BATCH}, {common.THREADS} threads; caches ready ({warm['seconds']:.1f} s, untimed); "
          f"load average at start {os.getloadavg()[0]:.2f}", flush=True)
    sides = {"lodger packed": lodger_side(packed_job)}
    show("lodger packed", sides["lodger packed"])
    sides["lodger unpacked"] = lodger_side(unpacked_job)
    show("lodger unpacked", sides["lodger unpacked"])
    per_pack = max(1, round(args.lines / sides["lodger packed"]["steps"]))  # examples per packed step
    for side in SIDES:
        sides[f"Trainer {side}"] = trainer_side(side, args, train, per_pack if side == "flattening" else common.BATCH)
        show(f"Trainer {side}", sides[f"Trainer {side}"])
    packed = sides["lodger packed"]
    best = max(("flattening", "group_by_length"), key=lambda k: sides[f"Trainer {k}"]["tps"])
    for label, other, goal in (("defaults", "Trainer defaults", ">= 1.5"),
                               (f"its best padding-free ({best})", f"Trainer {best}", ">= 1.0")):
        print(common.ratio_line("packed", f"lodger packed / Trainer {label} target-tokens-per-second ratio",
                                packed["tps"] / sides[other]["tps"],
                                f"{packed['tps']:.1f} vs {sides[other]['tps']:.1f}", goal))
    unpacked = sides["lodger unpacked"]
    print(common.ratio_line("packed", "lodger eval loss packed / unpacked after one epoch ratio",
                            packed["eval"] / unpacked["eval"],
                            f"{packed['eval']:.4f} vs {unpacked['eval']:.4f} after {packed['targets']} vs "
                            f"{unpacked['targets']} target tokens in {packed['steps']} vs {unpacked['steps']} steps",
                            "within 1 %"))
    print(f"# load average at end {os.getloadavg()[0]:.2f} (the machine has {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
