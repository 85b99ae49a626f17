"""Padding-free batches (issue 15): target tokens per second of lodger packed against the Hugging
Face ``Trainer``, and eval loss packed against unpacked after the same target tokens.

On a variable-length chat file made by ``make_chat_lengths.py`` (log-normal lengths, median 200
tokens, clipped to [12, max_length = 512]: most chats are a few hundred tokens, a tail reaches the
limit, as in chat SFT sets), one epoch each, in child processes of this script, one after the
other, on a tiny random Llama (TINY: the tests' architecture, hidden 256, 2 layers, the tests'
byte-level tokenizer; built once in the bench home) so a run takes minutes on 2 cores:

- ``lodger run`` with ``packing = true`` (each micro-batch of ``batch_size`` examples flattened
  into one row, no padding) and with ``packing = false`` (right-padded batches of ``batch_size``);
- ``lodger run`` with ``order = "length_grouped"`` (each step's examples of similar length) in
  three layouts: padded rows, one flattened row, and rows of at most max_length tokens
  (``pack_tokens = max_length``);
- the Trainer with its defaults (random sampler, batches of ``batch_size`` padded to their
  longest, by ``lodger.data.chats.collate``);
- the Trainer with ``DataCollatorWithFlattening`` (its padding-free collator: each batch one row
  with restarting position ids), batches of ``batch_size`` examples as lodger's;
- the Trainer with ``train_sampling_strategy="group_by_length"`` (batches of similar lengths).

Every side uses the same model folder, LoRA, learning rate schedule, threads, CPU priority
(``[limits] nice = 0``: lodger's default nice 10 would hand a loaded machine's cores to the
Trainer sides) and tokenised examples (``lodger.data.chats.tokenize``), and trains every example once, so every side counts
the same
target tokens (the labelled positions: printed per side). Target tokens per second are the
epoch's target tokens over the training steps' time: from the start of step 1 (lodger: its end
stamp in metrics.jsonl minus its duration; the Trainer: a step-begin callback) to the end of the
last step, so start-up, loading, the evals and the final checkpoint are left out; wall (process
start to exit) is printed too.

    python bench/packed_compare.py            # 256 chats up to 512 tokens
    python bench/packed_compare.py --quick    # 64 chats: a few minutes
    python bench/packed_compare.py --repeat 2 # every side twice, round robin; the faster run counts

The ratio lines compare ``lodger packed`` (shuffled order, packed) and the fastest lodger side
with the Trainer's defaults and with the faster of its padding-free options; the eval-loss lines
compare them with ``lodger unpacked`` (shuffled, padded) after the same target tokens: in the
same order that is the same steps, length-grouped it is other steps from the same examples.
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
# The tests' Llama architecture, wider: hidden 256, 2 layers, the tests' 384-token vocabulary (about
# 2M parameters), so an epoch of a few hundred chats takes minutes on 2 shared cores
TINY = {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 768}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=256, help="training chats")
    parser.add_argument("--eval-lines", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--median", type=float, default=200.0, help="median chat length in tokens")
    parser.add_argument("--sigma", type=float, default=0.8, help="log-normal spread of the lengths")
    parser.add_argument("--pack-tokens", type=int, help="lodger packed: [training] pack_tokens (default: one row)")
    parser.add_argument("--model", help="a model folder (default: the tiny random Llama, built once)")
    parser.add_argument("--quick", action="store_true", help="64 chats, 16 eval chats")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every side this many times, round robin; each side's fastest run counts")
    parser.add_argument("--skip", action="append", default=[], help="leave out the sides whose name contains this")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=common.BATCH, help=argparse.SUPPRESS)
    parser.add_argument("--train", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick and not args.child:
        args.lines, args.eval_lines = 64, 16
    return args


def tiny_model() -> Path:
    """The tests' tiny Llama architecture, wider (TINY), built once in the bench home."""
    sys.path.insert(0, str(common.ROOT / "tests"))
    from fixtures_lib import build_tiny_model  # noqa: E402

    folder = common.bench_home() / ("packed-model-" + "-".join(str(v) for v in TINY.values()))
    if not (folder / "model.safetensors").is_file():
        build_tiny_model(folder, seed=common.SEED, **TINY)
    return folder


def write_job(folder: Path, name: str, model: str, train: Path, eval_: Path, max_length: int, packing: bool,
              pack_tokens: int | None = None, order: str = "shuffle") -> Path:
    path = folder / f"{name}.toml"
    path.write_text(f"""name = "{name}"
[model]
source = "{model}"
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
order = "{order}"
{f"pack_tokens = {pack_tokens}" if pack_tokens and packing else ""}
[checkpoints]
keep_last = 2
[limits]
nice = 0
""")
    return path


# -- the Trainer's side (a child process) ---------------------------------------------------------
def trainer_child(args) -> None:
    import torch
    from transformers import (AutoTokenizer, DataCollatorWithFlattening, Trainer,
                              TrainerCallback, TrainingArguments)

    from lodger.data.chats import collate, read_jsonl, tokenize
    from lodger.model import model_folder, quiet_transformers, resolve_source, tokenizer_hash

    quiet_transformers()
    torch.set_num_threads(common.THREADS)
    folder = model_folder(resolve_source(args.model))
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
    begins: list[float] = []

    class Stamps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            begins.append(time.time())

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
    args.out.write_text(json.dumps({"start": begins[0], "ends": ends, "targets": targets[:len(ends)]}))


# -- the parent ---------------------------------------------------------------------------------
def tokens_per_s(start: float, ends: list[float], targets: list[int]) -> float:
    """The epoch's target tokens over the time from the start of step 1 to the end of step N."""
    return sum(targets) / (ends[-1] - start)


def lodger_side(job: Path) -> dict:
    result = common.run_lodger(job)
    records = [json.loads(line) for line in (Path(result.extra["folder"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    computed = sum(r.get("computed", 0) for r in steps)
    padded = sum(r.get("padded", 0) for r in steps)
    provenance = json.loads((Path(result.extra["folder"]) / "provenance.json").read_text())
    start = steps[0]["time"] - steps[0]["seconds"] - steps[0].get("held_seconds", 0.0)
    return {"result": result, "tps": tokens_per_s(start, [r["time"] for r in steps], [r["tokens"] for r in steps]),
            "steps": len(steps), "targets": sum(r["tokens"] for r in steps), "eval": evals[-1]["eval_loss"],
            "padding": padded / computed if computed else float("nan"),
            "order": provenance["segments"][0]["data"].get("order", "shuffle")}


def trainer_side(side: str, args, train: Path, batch: int) -> dict:
    out = common.bench_home() / f".packed-{side}-{os.getpid()}.json"
    argv = [sys.executable, __file__, "--child", side, "--batch", str(batch), "--train", str(train),
            "--max-length", str(args.max_length), "--model", str(args.model), "--out", str(out)]
    result = common.run_child(argv).check()
    report = json.loads(out.read_text())
    out.unlink()
    return {"result": result, "tps": tokens_per_s(report["start"], report["ends"], report["targets"]),
            "steps": len(report["ends"]), "targets": sum(report["targets"]), "batch": batch}


def show(name: str, s: dict) -> None:
    r = s["result"]
    extra = (f", padding {s['padding']:.2f}, eval loss {s['eval']:.4f}, order {s['order']}" if "eval" in s
             else f", batch {s['batch']}")
    print(f"# {name}: {s['tps']:.1f} target tokens/s, {s['steps']} steps, {s['targets']} target tokens"
          f"{extra}, wall {r.wall:.1f} s, cpu {r.cpu:.1f} s, peak rss {common.gib(r.peak_rss)}, "
          f"load {os.getloadavg()[0]:.2f}",
          flush=True)


def lodger_shapes(args) -> dict[str, tuple[bool, int | None, str]]:
    """lodger's sides: name -> (packing, pack_tokens, order). Shuffled: packed (one row per
    micro-batch, or --pack-tokens) and padded; length-grouped: padded rows, one flattened row, and
    rows of at most max_length tokens."""
    return {"lodger packed": (True, args.pack_tokens, "shuffle"),
            "lodger unpacked": (False, None, "shuffle"),
            "lodger grouped, padded": (False, None, "length_grouped"),
            "lodger grouped, packed one row": (True, None, "length_grouped"),
            "lodger grouped, packed rows of max_length": (True, args.max_length, "length_grouped")}


def ratios(sides: dict) -> None:
    """The issue's goal lines: the fastest lodger side against the Trainer's defaults and its faster
    padding-free option; eval losses of the packed and the fastest side against unpacked."""
    lodger = [name for name in sides if name.startswith("lodger")]
    fastest = max(lodger, key=lambda k: sides[k]["tps"])
    print(f"# fastest lodger side: {fastest}")
    best = max(("flattening", "group_by_length"), key=lambda k: sides[f"Trainer {k}"]["tps"])
    for mine in dict.fromkeys(("lodger packed", fastest)):
        for label, other, goal in (("defaults", "Trainer defaults", ">= 1.5"),
                                   (f"its best padding-free ({best})", f"Trainer {best}", ">= 1.0")):
            print(common.ratio_line("packed", f"{mine} / Trainer {label} target-tokens-per-second ratio",
                                    sides[mine]["tps"] / sides[other]["tps"],
                                    f"{sides[mine]['tps']:.1f} vs {sides[other]['tps']:.1f}", goal))
    unpacked = sides["lodger unpacked"]
    for mine in dict.fromkeys(("lodger packed", fastest)):
        s = sides[mine]
        print(common.ratio_line("packed", f"eval loss {mine} / lodger unpacked after one epoch ratio",
                                s["eval"] / unpacked["eval"],
                                f"{s['eval']:.4f} vs {unpacked['eval']:.4f} after {s['targets']} vs "
                                f"{unpacked['targets']} target tokens in {s['steps']} vs {unpacked['steps']} "
                                f"steps, order {s['order']} vs {unpacked['order']}", "within 1 %"))


def main() -> None:
    args = parse_args()
    common.use_bench_home()
    if args.child:
        trainer_child(args)
        return
    args.model = args.model or str(tiny_model())
    from lodger.data.chats import read_jsonl, tokenize
    from lodger.model import load_tokenizer, model_folder, resolve_source, tokenizer_hash
    from lodger.data.packing import example_lengths

    folder = model_folder(resolve_source(args.model))
    tokenizer = load_tokenizer(folder)
    calibration = make_chat_lengths.calibrate(tokenizer)  # plan lengths in this tokenizer's tokens
    jobs = Path(tempfile.mkdtemp(prefix="packed-", dir=common.bench_home()))
    train, eval_ = jobs / "train.jsonl", jobs / "eval.jsonl"
    make_chat_lengths.write(train, args.lines, args.max_length, args.median, args.sigma, common.SEED, *calibration)
    make_chat_lengths.write(eval_, args.eval_lines, args.max_length, args.median, args.sigma, common.SEED + 1,
                            *calibration)
    lengths = example_lengths(tokenize(read_jsonl(train), tokenizer, tokenizer_hash(folder), args.max_length))
    shapes = lodger_shapes(args)
    paths = {name: write_job(jobs, name.replace(" ", "-").replace(",", ""), args.model, train, eval_,
                             args.max_length, packing, tokens, order)
             for name, (packing, tokens, order) in shapes.items()}
    warm = common.warm_caches(paths["lodger packed"])
    print(make_chat_lengths.summary("tokenised", lengths, args.max_length, common.BATCH))
    print(f"# {args.lines} chats (+{args.eval_lines} eval) up to {args.max_length} tokens, one epoch, batch "
          f"{common.BATCH}, {common.THREADS} threads, model {args.model}; caches ready ({warm['seconds']:.1f} s, "
          f"untimed); target tokens/s over the training steps (start of step 1 to end of the last); "
          f"load average at start {os.getloadavg()[0]:.2f}", flush=True)
    runs = {name: (lambda path=path: lodger_side(path)) for name, path in paths.items()}
    runs.update({f"Trainer {side}": (lambda side=side: trainer_side(side, args, train, common.BATCH))
                 for side in SIDES})
    runs = {name: run for name, run in runs.items() if not any(word in name for word in args.skip)}
    sides: dict[str, dict] = {}
    for round_ in range(args.repeat):  # round robin: a burst of load elsewhere hits one run of each side
        for name, run in runs.items():
            side = run()
            show(f"{name} (run {round_ + 1})", side)
            if name not in sides or side["tps"] > sides[name]["tps"]:
                sides[name] = side
    if args.repeat > 1:
        print("# each side's fastest run:")
        for name, side in sides.items():
            show(name, side)
    targets = {name: side["targets"] for name, side in sides.items()}
    if len(set(targets.values())) != 1:
        print(f"# WARNING: the sides trained different target tokens: {targets}")
    ratios(sides)
    print(f"# load average at end {os.getloadavg()[0]:.2f} (the machine has {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
