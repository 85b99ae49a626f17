#!/usr/bin/env python3
"""Generate lodger's bundled demo dataset.

The demo teaches SmolLM2-135M-Instruct a distinctive, easy-to-see answer
style: every reply starts with ``Lodger says:``, gives one short templated
sentence, and ends with the sign-off ``Cheers, Lodger.``.  The questions are
small families (capitals, addition, unit conversions, opposites, plurals)
whose answers are computed or looked up here, so every answer is correct.

Run from the repository root::

    python scripts/make_demo_data.py

It writes ``src/lodger/demo/{train.jsonl,eval.jsonl,prompts.json}``.  The
output is deterministic (seeded ``random.Random``, stdlib only).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 1234
N_TRAIN = 480
N_EVAL = 48
OUT_DIR = Path(__file__).resolve().parent.parent / "src" / "lodger" / "demo"

PREFIX = "Lodger says:"
SIGNOFF = "Cheers, Lodger."

# Held-out prompts shown before/after training.  Their subjects (Japan,
# "early", "mouse", 7 kilograms, 38 + 45) never appear in train or eval.
PROMPTS = [
    "What is the capital of Japan?",
    "How many grams are in 7 kilograms?",
    "What is 38 plus 45?",
    "What is the opposite of 'early'?",
    "What is the plural of 'mouse'?",
]
HELD_OUT_COUNTRIES = {"Japan"}
HELD_OUT_WORDS = {"early", "late", "mouse"}

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Portugal": "Lisbon", "Ireland": "Dublin", "Belgium": "Brussels",
    "the Netherlands": "Amsterdam", "Austria": "Vienna", "Switzerland": "Bern",
    "Poland": "Warsaw", "Sweden": "Stockholm", "Norway": "Oslo",
    "Finland": "Helsinki", "Denmark": "Copenhagen", "Greece": "Athens",
    "Hungary": "Budapest", "Czechia": "Prague", "Romania": "Bucharest",
    "Bulgaria": "Sofia", "Ukraine": "Kyiv", "Russia": "Moscow",
    "Turkey": "Ankara", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Nigeria": "Abuja", "Ghana": "Accra", "Morocco": "Rabat",
    "Ethiopia": "Addis Ababa", "South Korea": "Seoul", "China": "Beijing",
    "India": "New Delhi", "Thailand": "Bangkok", "Vietnam": "Hanoi",
    "Indonesia": "Jakarta", "the Philippines": "Manila", "Iran": "Tehran",
    "Iraq": "Baghdad", "Saudi Arabia": "Riyadh", "Pakistan": "Islamabad",
    "Australia": "Canberra", "New Zealand": "Wellington", "Canada": "Ottawa",
    "the United States": "Washington, D.C.", "Mexico": "Mexico City",
    "Cuba": "Havana", "Peru": "Lima", "Chile": "Santiago",
    "Argentina": "Buenos Aires", "Colombia": "Bogota", "Brazil": "Brasilia",
    "Venezuela": "Caracas", "Iceland": "Reykjavik", "Japan": "Tokyo",
}

# (unit, plural, smaller unit plural, factor)
CONVERSIONS = [
    ("metre", "metres", "centimetres", 100),
    ("kilometre", "kilometres", "metres", 1000),
    ("kilogram", "kilograms", "grams", 1000),
    ("litre", "litres", "millilitres", 1000),
    ("hour", "hours", "minutes", 60),
    ("minute", "minutes", "seconds", 60),
    ("day", "days", "hours", 24),
    ("week", "weeks", "days", 7),
    ("year", "years", "months", 12),
    ("dozen", "dozen", "eggs", 12),
]

OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "happy": "sad",
    "light": "dark", "up": "down", "open": "closed", "full": "empty",
    "strong": "weak", "rich": "poor", "young": "old", "loud": "quiet",
    "hard": "soft", "wet": "dry", "tall": "short", "heavy": "light",
    "clean": "dirty", "thick": "thin", "early": "late", "near": "far",
    "win": "lose", "push": "pull", "buy": "sell", "inside": "outside",
    "true": "false", "cheap": "expensive", "safe": "dangerous",
    "begin": "end", "brave": "afraid", "wide": "narrow", "sharp": "blunt",
    "friend": "enemy", "day": "night", "north": "south", "east": "west",
    "arrive": "leave", "remember": "forget", "always": "never",
}

PLURALS = {
    "cat": "cats", "dog": "dogs", "box": "boxes", "child": "children",
    "man": "men", "woman": "women", "tooth": "teeth", "foot": "feet",
    "goose": "geese", "mouse": "mice", "person": "people", "city": "cities",
    "baby": "babies", "leaf": "leaves", "knife": "knives", "wolf": "wolves",
    "bus": "buses", "church": "churches", "potato": "potatoes",
    "tomato": "tomatoes", "sheep": "sheep", "fish": "fish", "deer": "deer",
    "ox": "oxen", "cactus": "cacti", "story": "stories",
    "party": "parties", "wish": "wishes", "glass": "glasses",
    "house": "houses", "book": "books", "tree": "trees", "apple": "apples",
}


def answer(text: str) -> str:
    return f"{PREFIX} {text} {SIGNOFF}"


def capital_example(rng: random.Random) -> tuple[str, str]:
    country = rng.choice(sorted(set(CAPITALS) - HELD_OUT_COUNTRIES))
    capital = CAPITALS[country]
    q = rng.choice([
        "What is the capital of {c}?",
        "What's the capital of {c}?",
        "Which city is the capital of {c}?",
        "Name the capital of {c}.",
        "Tell me the capital city of {c}.",
    ]).format(c=country)
    return q, answer(f"The capital of {country} is {capital}.")


def addition_example(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    q = rng.choice([
        "What is {a} plus {b}?",
        "What's {a} + {b}?",
        "Add {a} and {b}.",
        "What is the sum of {a} and {b}?",
        "Compute {a} + {b}.",
    ]).format(a=a, b=b)
    return q, answer(f"{a} plus {b} is {a + b}.")


def conversion_example(rng: random.Random) -> tuple[str, str]:
    unit, units, small, factor = rng.choice(CONVERSIONS)
    n = rng.randint(1, 12)
    big = unit if n == 1 else units
    q = rng.choice([
        "How many {s} are in {n} {b}?",
        "How many {s} are there in {n} {b}?",
        "Convert {n} {b} to {s}.",
        "What is {n} {b} in {s}?",
    ]).format(s=small, n=n, b=big)
    return q, answer(f"{n} {big} is {n * factor} {small}.")


def opposite_example(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(sorted(set(OPPOSITES) - HELD_OUT_WORDS))
    opp = OPPOSITES[word]
    q = rng.choice([
        "What is the opposite of '{w}'?",
        "What's the opposite of {w}?",
        "Give me the opposite of the word '{w}'.",
        "What word means the opposite of '{w}'?",
    ]).format(w=word)
    return q, answer(f"The opposite of {word} is {opp}.")


def plural_example(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(sorted(set(PLURALS) - HELD_OUT_WORDS))
    plural = PLURALS[word]
    q = rng.choice([
        "What is the plural of '{w}'?",
        "What's the plural of {w}?",
        "How do you say more than one {w}?",
        "Give me the plural form of '{w}'.",
    ]).format(w=word)
    return q, answer(f"The plural of {word} is {plural}.")


FAMILIES = [
    capital_example,
    addition_example,
    conversion_example,
    opposite_example,
    plural_example,
]


def build(rng: random.Random, n: int, seen: set[str]) -> list[dict]:
    rows = []
    while len(rows) < n:
        family = FAMILIES[len(rows) % len(FAMILIES)]
        q, a = family(rng)
        if q in seen:
            continue
        seen.add(q)
        rows.append({"messages": [
            {"role": "user", "content": q},
            {"role": "assistant", "content": a},
        ]})
    rng.shuffle(rows)
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    rng = random.Random(SEED)
    seen = set(PROMPTS)  # never emit a held-out prompt
    train = build(rng, N_TRAIN, seen)
    eval_ = build(rng, N_EVAL, seen)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    write_jsonl(OUT_DIR / "train.jsonl", train)
    write_jsonl(OUT_DIR / "eval.jsonl", eval_)
    with (OUT_DIR / "prompts.json").open("w", encoding="utf-8", newline="\n") as fh:
        json.dump(PROMPTS, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
    print(f"wrote {len(train)} train, {len(eval_)} eval, "
          f"{len(PROMPTS)} prompts to {OUT_DIR}")


if __name__ == "__main__":
    main()
