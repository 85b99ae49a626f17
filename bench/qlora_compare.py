"""A LoRA job on a 4-bit and an 8-bit base against the full-precision base, and against TRL.

On SmolLM2-135M (LoRA r=8 on q/v, batch 4 x 128, 2 threads, bench/common.py's job), one child
process each, one after the other: lodger with the fp32 base (what lodger trains on a CPU: the
weights stay fp32, a 16-bit run would autocast over the same copy), with `base_bits = 4` (NF4,
double quantisation) and `base_bits = 8` (LLM.int8); then the anchor, the same 4-bit job in TRL's
``SFTTrainer`` with peft (transformers' ``BitsAndBytesConfig``, lodger's tokenised examples in
lodger's batch order, padded by ``lodger.data.chats.collate``, no gradient checkpointing, as lodger).
Each lodger side evaluates the bundled held-out chats (src/lodger/demo/eval.jsonl) after the
last step. Peak RSS is each child's ``ru_maxrss`` (``os.wait4``); steps per second from the end
of step 1 to the end of the last step. The base's share is the bytes the loaded base holds
(every tensor of its state, quantisation scales included, tied weights once) against the same
model in 16 bits (2 bytes a parameter).

    python bench/qlora_compare.py              # 10 steps a side (a few minutes on 2 idle cores)
    python bench/qlora_compare.py --steps 40   # the eval losses further apart

Result lines: `qlora: 4-bit/16-bit base-bytes ratio 0.61 (...)`, `qlora: 4-bit/fp32-base peak-RSS
ratio 0.88 (...)`, steps/s and eval-loss lines, and `qlora: lodger/TRL 4-bit steps-per-second ratio ...`.
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

EVAL = common.ROOT / "src" / "lodger" / "demo" / "eval.jsonl"
MiB = 2**20


def write_job(folder: Path, steps: int, bits: int | None, source: str | None = None) -> Path:
    """bench/common.py's job at nice 0, one checkpoint at the end, the held-out chats evaluated
    after the last step, the base in ``bits`` (None: fp32). ``source``: the dequantised SmolLM2
    folder lodger caches, as a plain folder (a GGUF source is refused with base_bits), on every side."""
    name = f"qlora-{bits or 32}"
    path = common.write_job(folder, steps, every_steps=steps, name=name, nice=0)
    text = path.read_text()
    if source:
        text = text.replace(f'source = "{common.MODEL_ALIAS}"', f'source = "{source}"')
    text = text.replace('kind = "lora"\n', 'kind = "lora"\n' + (f"base_bits = {bits}\n" if bits else ""))
    text = text.replace("eval_fraction = 0.0\n", f'eval_fraction = 0.0\neval = "{EVAL}"\n')
    text = text.replace("log_every = 1000000\n", f"log_every = 1000000\neval_every = {steps}\n")
    path.write_text(text)
    return path


def eval_loss(folder: str) -> float:
    records = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if r["kind"] == "eval"][-1]["eval_loss"]


def trl_child(steps: int, out: Path) -> None:
    """The anchor: TRL's SFTTrainer with peft on the base quantised to 4 bits by transformers."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from lodger.data.chats import collate, read_jsonl, tokenize
    from lodger.model import model_folder, quiet_transformers, resolve_source, tokenizer_hash

    quiet_transformers()
    torch.set_num_threads(common.THREADS)
    folder = model_folder(resolve_source(common.MODEL_ALIAS))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    data = tokenize(read_jsonl(common.train_data()), tokenizer, tokenizer_hash(folder), common.MAX_LENGTH)
    quantised = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32,
                                                 quantization_config=quantised, device_map="cpu")
    model.config.use_cache = False
    ordered = [i for batch in common.batch_order(len(data), steps) for i in batch]
    examples = Dataset.from_list([{"index": i} for i in ordered])

    def collator(features):
        return collate(data, [f["index"] for f in features], tokenizer.pad_token_id)

    ends: list[float] = []

    class Stamps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.time())

    with tempfile.TemporaryDirectory(dir=common.bench_home()) as tmp:
        args = SFTConfig(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=common.BATCH, learning_rate=common.LR,
            lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": common.MIN_LR_RATIO},
            warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, save_strategy="no", report_to="none", use_cpu=True,
            logging_steps=1, remove_unused_columns=False, train_sampling_strategy="sequential",
            dataloader_num_workers=0, dataloader_pin_memory=False, disable_tqdm=True, seed=common.SEED, bf16=False,
            gradient_checkpointing=False, dataset_kwargs={"skip_prepare_dataset": True})
        peft = LoraConfig(r=common.RANK, lora_alpha=common.ALPHA, lora_dropout=0.0, target_modules=list(common.TARGETS),
                          bias="none", task_type="CAUSAL_LM")
        torch.manual_seed(common.SEED)
        trainer = SFTTrainer(model=model, args=args, train_dataset=examples, data_collator=collator,
                             processing_class=tokenizer, peft_config=peft, callbacks=[Stamps()])
        trainer.train()
    out.write_text(json.dumps({"ends": ends, "optim": args.optim}))


def base_bytes(folder: str) -> dict[str, float]:
    """Bytes each base holds once loaded as lodger loads it: fp32, 8-bit and 4-bit (every tensor of
    its state, quantisation scales included, tied weights once), and the decoder linears' part."""
    import torch

    from lodger import quant

    found: dict[str, float] = {}
    for bits in (4, 8):
        model = quant.load_quantised(folder, bits, "cpu", torch.float32)
        seen, total = set(), 0
        for tensor in model.state_dict().values():
            if isinstance(tensor, torch.Tensor) and tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel() * tensor.element_size()
        linears = {}
        for name, module in quant.quantised_modules(model).items():
            state: dict = {}
            module._save_to_state_dict(state, "", keep_vars=False)
            linears[name] = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
        found[f"{bits}-bit"], found[f"{bits}-bit linears"] = total, sum(linears.values())
        found["linear params"] = sum(m.in_features * m.out_features for m in quant.quantised_modules(model).values())
        found["params"] = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        del model
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--child-trl", dest="child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    common.use_bench_home()
    if args.child:
        trl_child(args.steps, args.out)
        return
    jobs = Path(tempfile.mkdtemp(prefix="jobs-", dir=common.bench_home()))
    warm = common.warm_caches(write_job(jobs, args.steps, None))
    print(f"# {args.steps} steps a side, batch {common.BATCH} x {common.MAX_LENGTH}, LoRA r={common.RANK} on "
          f"{'/'.join(common.TARGETS)}, {common.THREADS} threads; caches ready ({warm['seconds']:.1f} s, untimed); "
          f"load average at start {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)", flush=True)
    runs = {}
    for bits in (None, 4, 8):
        label = f"{bits}-bit" if bits else "fp32"
        result = common.run_lodger(write_job(jobs, args.steps, bits, warm["folder"]))
        result.extra.update(sps=common.steady_steps_per_s(result.extra["ends"]), eval=eval_loss(result.extra["folder"]))
        runs[label] = result
        print(f"# lodger {label}: {result.extra['sps']:.3f} steps/s, wall {result.wall:.1f} s, peak rss "
              f"{common.gib(result.peak_rss)}, eval loss {result.extra['eval']:.4f}, load {os.getloadavg()[0]:.2f}",
              flush=True)
    trl = common.run_script_child(__file__, "--child-trl", args.steps)
    trl.extra["sps"] = common.steady_steps_per_s(trl.extra["ends"])
    print(f"# TRL SFTTrainer 4-bit: {trl.extra['sps']:.3f} steps/s, wall {trl.wall:.1f} s, peak rss "
          f"{common.gib(trl.peak_rss)}, optimizer {trl.extra['optim']}, load {os.getloadavg()[0]:.2f}", flush=True)
    report(runs, trl, base_bytes(warm["folder"]))
    print(f"# load average at end {os.getloadavg()[0]:.2f}")


def report(runs: dict, trl, held: dict[str, float]) -> None:
    full, sixteen = runs["fp32"], 2.0 * held["params"]
    linears16 = 2.0 * held["linear params"]
    for bits in ("4-bit", "8-bit"):
        print(f"qlora: {bits}/16-bit base-bytes ratio {held[bits] / sixteen:.2f} (the {bits} base holds "
              f"{held[bits] / MiB:.0f} MiB, in 16 bits {sixteen / MiB:.0f} MiB; its decoder linears alone "
              f"{held[bits + ' linears'] / linears16:.2f}: {held[bits + ' linears'] / MiB:.0f} against "
              f"{linears16 / MiB:.0f} MiB; embeddings and norms stay fp32{'; goal <= 0.35' if bits == '4-bit' else ''})")
    for bits in ("4-bit", "8-bit"):
        run = runs[bits]
        print(f"qlora: {bits}/fp32-base peak-RSS ratio {run.peak_rss / full.peak_rss:.2f} "
              f"({common.gib(run.peak_rss)} against {common.gib(full.peak_rss)}, whole processes)")
        print(f"qlora: {bits}/fp32-base steps-per-second ratio {run.extra['sps'] / full.extra['sps']:.2f} "
              f"({run.extra['sps']:.3f} against {full.extra['sps']:.3f} steps/s)")
        change = run.extra["eval"] / full.extra["eval"] - 1.0
        print(f"qlora: {bits}/fp32-base eval-loss ratio {run.extra['eval'] / full.extra['eval']:.4f} "
              f"({run.extra['eval']:.4f} against {full.extra['eval']:.4f}, {change:+.2%}, after the same steps; "
              f"goal within 2 %)")
    mine = runs["4-bit"]
    print(f"qlora: lodger/TRL 4-bit steps-per-second ratio {mine.extra['sps'] / trl.extra['sps']:.2f} "
          f"(lodger {mine.extra['sps']:.3f}, TRL SFTTrainer {trl.extra['sps']:.3f} steps/s; goal >= 1.0)")
    print(f"qlora: lodger/TRL 4-bit peak-RSS ratio {mine.peak_rss / trl.peak_rss:.2f} "
          f"(lodger {common.gib(mine.peak_rss)}, TRL SFTTrainer {common.gib(trl.peak_rss)}; goal <= 1.0)")


if __name__ == "__main__":
    main()
