#!/usr/bin/env python3
"""Generate lodger's bundled preference pairs from the bundled demo chats.

Each pair asks the demo's question; `chosen` is the demo's styled answer ("Lodger says: ...
Cheers, Lodger."), `rejected` the same facts without the style, so a preference run (DPO, ORPO,
or KTO on the pairs unpaired) learns the style from comparisons alone. TRL's conversational
preference format: prompt, chosen and rejected are message lists.

Run from the repository root (after scripts/make_demo_data.py)::

    python scripts/make_preference_data.py

It writes ``src/lodger/demo/{preference.jsonl,preference_eval.jsonl}``; deterministic.
"""

from __future__ import annotations

import json
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "src" / "lodger" / "demo"
PREFIX, SIGNOFF = "Lodger says: ", " Cheers, Lodger."
N_TRAIN, N_EVAL = 96, 16


def pairs(path: Path, limit: int) -> list[dict]:
    out = []
    for line in path.read_text().splitlines()[:limit]:
        chat = json.loads(line)["messages"]
        user, answer = chat[0]["content"], chat[-1]["content"]
        plain = answer.removeprefix(PREFIX).removesuffix(SIGNOFF)
        if plain == answer:
            continue
        out.append({"prompt": [{"role": "user", "content": user}],
                    "chosen": [{"role": "assistant", "content": answer}],
                    "rejected": [{"role": "assistant", "content": plain}]})
    return out


def main() -> None:
    for name, source, limit in (("preference.jsonl", "train.jsonl", N_TRAIN),
                                ("preference_eval.jsonl", "eval.jsonl", N_EVAL)):
        rows = pairs(DEMO / source, limit)
        (DEMO / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} pairs to {DEMO / name}")


if __name__ == "__main__":
    main()
