"""lm-eval task data built from lodger's demo eval set (../eval.jsonl), for the two tiny tasks here.

Each eval example becomes one two-way multiple-choice question, scored by loglikelihood:
- ``lodger_demo_answer``: the demo's own answer against another example's answer to a question
  of the same kind (does the model still pick the right content?);
- ``lodger_demo_style``: the answer in the demo's style ("Lodger says: ... Cheers, Lodger.")
  against the same sentence without it (did fine-tuning teach the style?).
The right choice alternates between first and second place. Standard library only: lm-eval
imports this file by path (``custom_dataset: !function docs.answer_docs`` in the YAML files).
"""

from __future__ import annotations

import json
from pathlib import Path

EVAL_FILE = Path(__file__).resolve().parent.parent / "eval.jsonl"
PREFIX, SIGNOFF = "Lodger says: ", " Cheers, Lodger."


def _pairs() -> list[tuple[str, str]]:
    """(question, answer) of every demo eval example, in file order."""
    pairs = []
    for line in EVAL_FILE.read_text(encoding="utf-8").splitlines():
        if line.strip():
            messages = json.loads(line)["messages"]
            pairs.append((messages[0]["content"], messages[-1]["content"]))
    return pairs


def _plain(answer: str) -> str:
    """The answer's sentence without the demo's opening and sign-off."""
    return answer.removeprefix(PREFIX).removesuffix(SIGNOFF).strip()


def _distractor(pairs: list[tuple[str, str]], i: int) -> str:
    """The answer of the next example whose question starts with the same word (same kind of
    question), else of the next example: a wrong answer in the same style."""
    first = pairs[i][0].split()[0]
    order = [(i + k) % len(pairs) for k in range(1, len(pairs))]
    same = [j for j in order if pairs[j][0].split()[0] == first and pairs[j][1] != pairs[i][1]]
    return pairs[same[0] if same else order[0]][1]


def _row(i: int, question: str, right: str, wrong: str) -> dict:
    label = i % 2
    choices = [right, wrong] if label == 0 else [wrong, right]
    return {"id": i, "question": question, "choices": choices, "label": label}


def _dataset(rows: list[dict]):
    import datasets  # lm-eval's own dependency; imported only when lm-eval builds the task

    return {"test": datasets.Dataset.from_list(rows)}


def answer_docs(**_metadata):
    pairs = _pairs()
    return _dataset([_row(i, q, a, _distractor(pairs, i)) for i, (q, a) in enumerate(pairs)])


def style_docs(**_metadata):
    return _dataset([_row(i, q, a, _plain(a)) for i, (q, a) in enumerate(_pairs())])
