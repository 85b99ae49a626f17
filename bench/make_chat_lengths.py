"""Write a chat JSONL whose lengths spread like real fine-tuning data (issue 15's benchmarks).

Each line is a learnable chat (the assistant reverses the words the user gives, so eval loss
after N target tokens means something) whose length in words is drawn from a log-normal
distribution, clipped to [a dozen tokens, the length limit]: most chats are short, a long tail
reaches the limit, as in chat data sets. Deterministic by seed: same arguments, same bytes.

    python bench/make_chat_lengths.py out.jsonl --lines 2000 --max-length 512 --seed 0
    python bench/make_chat_lengths.py out.jsonl --model /path/to/model   # also prints token lengths

Lengths are planned in words at TOKENS_PER_WORD (SmolLM2's tokenizer); ``--model`` measures that
ratio for the model's own tokenizer first, then tokenises the result with lodger's own code and
prints the real token distribution (chat template included).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path

WORDS = ("red blue green cat dog sun moon tree fish bird star rock milk cake book door lamp rain snow "
         "wind fire ship road hill lake apple river stone cloud field house bread chair glass light "
         "night paper plant sound table water world bright quiet little happy early").split()
TOKENS_PER_WORD = 1.3  # a word of WORDS plus its space, about, for SmolLM2's tokenizer
TEMPLATE_TOKENS = 12   # role markers and newlines of a two-turn ChatML chat


def planned_lengths(lines: int, max_length: int, median: float, sigma: float, seed: int) -> list[int]:
    """Token lengths: log-normal around ``median``, clipped to [12, max_length]."""
    rng = random.Random(seed)
    return [int(min(max_length, max(12, rng.lognormvariate(math.log(median), sigma)))) for _ in range(lines)]


def chat(tokens: int, rng: random.Random, per_word: float = TOKENS_PER_WORD, template: int = TEMPLATE_TOKENS) -> dict:
    """A user turn of k words and the assistant's reversal: 2k words ~ ``tokens`` minus the template."""
    k = max(1, int((tokens - template) / (2 * per_word)))
    words = [rng.choice(WORDS) for _ in range(k)]
    return {"messages": [{"role": "user", "content": "reverse: " + " ".join(words)},
                         {"role": "assistant", "content": " ".join(reversed(words))}]}


def calibrate(tokenizer) -> tuple[float, int]:
    """(tokens per word, template tokens) of this tokenizer, from a chat of every word."""
    def count(k: int) -> int:
        words = (WORDS * 4)[:k]
        messages = [{"role": "user", "content": "reverse: " + " ".join(words)},
                    {"role": "assistant", "content": " ".join(reversed(words))}]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    small, large = count(1), count(4 * len(WORDS))
    per_word = (large - small) / (2 * (4 * len(WORDS) - 1))
    return per_word, max(0, int(small - 2 * per_word))


def write(path: Path, lines: int, max_length: int, median: float, sigma: float, seed: int,
          per_word: float = TOKENS_PER_WORD, template: int = TEMPLATE_TOKENS) -> list[int]:
    rng = random.Random(seed + 1)
    lengths = planned_lengths(lines, max_length, median, sigma, seed)
    text = "".join(json.dumps(chat(n, rng, per_word, template), ensure_ascii=False) + "\n" for n in lengths)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return lengths


def summary(name: str, lengths: list[int], max_length: int, batch: int) -> str:
    q = statistics.quantiles(lengths, n=20)
    batches = [lengths[k:k + batch] for k in range(0, len(lengths), batch)]
    padded = sum(len(b) * max(b) for b in batches)
    return (f"# {name}: {len(lengths)} chats, min {min(lengths)}, p5 {q[0]:.0f}, "
            f"median {statistics.median(lengths):.0f}, "
            f"p95 {q[-1]:.0f}, max {max(lengths)} (limit {max_length}); padding share of batches of {batch} "
            f"in file order padded to their longest: {1 - sum(lengths) / padded:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--max-length", type=int, default=512, help="the job's [data] max_length")
    ap.add_argument("--median", type=float, default=96.0, help="median chat length in tokens")
    ap.add_argument("--sigma", type=float, default=0.9, help="log-normal sigma (spread)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=4, help="batch size for the padding-share line")
    ap.add_argument("--model", type=Path, help="a model folder: tokenise and print the real token lengths")
    args = ap.parse_args()
    calibration = (TOKENS_PER_WORD, TEMPLATE_TOKENS)
    if args.model:  # plan in this tokenizer's tokens, not SmolLM2's
        from common import use_bench_home

        use_bench_home()  # the token cache goes to the bench home, never ~/.lodger
        from lodger.model import load_tokenizer

        tokenizer = load_tokenizer(args.model)
        calibration = calibrate(tokenizer)
        print(f"# {args.model}: {calibration[0]:.2f} tokens per word, {calibration[1]} template tokens")
    planned = write(args.out, args.lines, args.max_length, args.median, args.sigma, args.seed, *calibration)
    print(summary("planned tokens", planned, args.max_length, args.batch))
    if args.model:
        from lodger.data.chats import read_jsonl, tokenize
        from lodger.data.packing import example_lengths

        data = tokenize(read_jsonl(args.out), tokenizer, f"bench:{args.model}", args.max_length)
        print(summary("tokenised", example_lengths(data), args.max_length, args.batch))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
