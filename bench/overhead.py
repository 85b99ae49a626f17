"""What lodger costs over a plain PyTorch + peft loop on the same LoRA job.

Both sides run as child processes of this script, one after the other (alternating when
repeated), with the same environment, thread count, model folder, tokenised data and batch order:

- lodger: ``lodger run JOB --quiet`` with a checkpoint every 50 steps (and the final one);
- plain: a hand-written loop (fused AdamW, the same warmup-free cosine to 10 %, clip at 1.0,
  ``use_cache=False``, the loss from ``model(**batch).loss``) that saves the adapter at the end.

Headline: total process wall time (both include imports and the model load). Also printed: the
training loop alone (start of step 1 to end of the last step, from each side's per-step stamps),
the CPU seconds of each child (less sensitive to other load on the machine), and the largest
per-step loss difference.

    python bench/overhead.py            # 100 steps, one run each (about 4-5 minutes here)
    python bench/overhead.py --quick    # 20 steps, checkpoints every 10
    python bench/overhead.py --steps 200 --repeats 2
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


def plain_child(steps: int, out: Path) -> None:
    """The comparison: the loop a careful person writes by hand."""
    import math

    import torch
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import AutoTokenizer

    from lodger.data.chats import collate, read_jsonl, tokenize
    from lodger.model import model_folder, resolve_source, tokenizer_hash

    torch.set_num_threads(common.THREADS)
    folder = model_folder(resolve_source(common.MODEL_ALIAS))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    data = tokenize(read_jsonl(common.train_data()), tokenizer, tokenizer_hash(folder), common.MAX_LENGTH)
    model = common.lora_model(folder)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=common.LR, weight_decay=0.0, fused=True)
    floor = common.MIN_LR_RATIO
    schedule = LambdaLR(optimizer, lambda s: floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    order = common.batch_order(len(data), steps)
    losses, ends, seconds = [], [], []
    model.train()
    for ids in order:
        started = time.perf_counter()
        batch = collate(data, ids, tokenizer.pad_token_id)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        ends.append(time.time())
        seconds.append(time.perf_counter() - started)
    with tempfile.TemporaryDirectory(dir=common.bench_home()) as tmp:
        model.save_pretrained(tmp)
    out.write_text(json.dumps({"losses": losses, "ends": ends, "seconds": seconds}))


def main() -> None:
    args = common.side_by_side_args(__doc__, "--child-plain")
    if args.child:
        plain_child(args.steps, args.out)
        return
    job, warm = common.prepared_job(args.steps, args.every, "overhead")
    print(f"# {args.steps} steps, batch {common.BATCH} x {common.MAX_LENGTH}, {common.THREADS} threads, "
          f"lodger checkpoints every {args.every}; caches ready ({warm['seconds']:.1f} s, untimed); "
          f"load average at start {os.getloadavg()[0]:.2f}", flush=True)

    def report(side, result):
        print(f"# {side}: wall {result.wall:.1f} s, cpu {result.cpu:.1f} s, loop "
              f"{common.loop_span(result.extra['ends'], result.extra['seconds']):.1f} s, "
              f"peak rss {common.gib(result.peak_rss)}, load {os.getloadavg()[0]:.2f}", flush=True)

    runs = common.alternate(job, __file__, "--child-plain", "plain", args, report)

    lw = common.median([r.wall for r in runs["lodger"]])
    pw = common.median([r.wall for r in runs["plain"]])
    ll = common.median([common.loop_span(r.extra["ends"], r.extra["seconds"]) for r in runs["lodger"]])
    pl = common.median([common.loop_span(r.extra["ends"], r.extra["seconds"]) for r in runs["plain"]])
    lc = common.median([r.cpu for r in runs["lodger"]])
    pc = common.median([r.cpu for r in runs["plain"]])
    ck = runs["lodger"][-1].extra["checkpoint_seconds"]
    diff = common.max_abs_diff(runs["lodger"][0].extra["losses"], runs["plain"][0].extra["losses"])
    n = min(len(runs["lodger"][0].extra["losses"]), len(runs["plain"][0].extra["losses"]))
    print(f"overhead: lodger/plain wall-time ratio {lw / pw:.2f} (lodger {lw:.1f} s, plain {pw:.1f} s; "
          f"total process wall time incl. model load, median of {args.repeats}; goal <= 1.05)")
    print(f"overhead: lodger/plain training-loop ratio {ll / pl:.2f} (lodger {ll:.1f} s, plain {pl:.1f} s; "
          f"start of step 1 to end of step {args.steps}, lodger's final checkpoint not included)")
    print(f"overhead: lodger/plain cpu-time ratio {lc / pc:.2f} (lodger {lc:.1f} s, plain {pc:.1f} s)")
    print(f"overhead: lodger checkpoints {len(ck)} x, {sum(ck):.2f} s in all "
          f"({', '.join(f'{c:.2f}' for c in ck)} s)")
    print(f"losses: max abs diff {diff:.2e} over {n} steps ({'match' if diff < 1e-3 else 'DIFFER'}; "
          f"first {runs['lodger'][0].extra['losses'][0]:.4f} vs {runs['plain'][0].extra['losses'][0]:.4f}, "
          f"last {runs['lodger'][0].extra['losses'][-1]:.4f} vs {runs['plain'][0].extra['losses'][-1]:.4f})")
    print(f"# load average at end {os.getloadavg()[0]:.2f} (the machine has {os.cpu_count()} cores; "
          "other work on it inflates both sides' wall time)")


if __name__ == "__main__":
    main()
