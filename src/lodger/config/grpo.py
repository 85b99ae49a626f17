"""[grpo] and [[rewards]]: reinforcement learning from rewards a program computes (docs/grpo.md).

The defaults are TRL 1.16's GRPOConfig where lodger has the same knob (so runs compare), except
where a home machine argues otherwise (say so on the field)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from .base import Float, Int, Section


class GRPOConfig(Section):
    num_generations: Int = Field(8, ge=2, le=256)
    """G: completions sampled for each prompt. Each prompt's rewards are compared within its group
    of G (the advantage is a completion's reward against its group's mean), so G >= 2."""
    max_completion_length: Int = Field(256, ge=1, le=32768)
    """Tokens generated at most per completion; a completion that reaches it without the end-of-turn
    token is truncated."""
    temperature: Float = Field(1.0, gt=0, le=10)
    """Sampling temperature of the completions; the log-probabilities of the loss are taken at the
    same temperature (as TRL does)."""
    top_p: Float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1: all)."""
    top_k: Int = Field(0, ge=0)
    """Sample among the k most likely tokens only (0: no limit)."""
    beta: Float = Field(0.0, ge=0)
    """Weight of the KL term to the reference (0: none, TRL's default, no reference pass). The
    reference: for LoRA the model with the adapter disabled (no second copy); for full fine-tuning
    a frozen copy of the base model (counted by `lodger estimate`)."""
    epsilon: Float = Field(0.2, gt=0, lt=1)
    """Clipping range of the probability ratio: [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: Float | None = Field(None, gt=0)
    """Upper clipping bound (DAPO's "clip higher" suggests 0.28); left out, equal to epsilon."""
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = "dapo"
    """How the per-token losses are averaged (docs/grpo.md): `dapo` (TRL's default), over every
    completion token of the step; `grpo`, each completion's mean, then the mean over completions
    (favours short right answers and long wrong ones); `dr_grpo`, the sum over the step divided by
    completions x max_completion_length (Dr. GRPO). All three equal TRL's loss (tested)."""
    scale_rewards: Literal["group", "none"] = "group"
    """`group`: advantages divided by their group's standard deviation (GRPO); `none`: not
    scaled (Dr. GRPO's advice: scaling favours prompts that are too easy or too hard)."""
    num_iterations: Int = Field(1, ge=1, le=64)
    """Optimizer steps taken on each batch of completions (GRPO's mu): generation is most of a
    step's time, so mu > 1 trains more per completion, with the clipped ratio against the
    log-probabilities kept from when they were generated (kept in every checkpoint)."""
    mask_truncated_completions: bool = False
    """Leave completions that hit max_completion_length out of the loss (DAPO's advice)."""
    eval_samples: Int = Field(3, ge=0, le=64)
    """At each eval, this many held-out prompts are kept with their completions and rewards
    (metrics.jsonl; `lodger show` prints the newest)."""


class RewardConfig(Section):
    kind: Literal["answer", "format", "length", "python", "code"]
    """`answer`: 1 when the answer extracted from the completion equals the line's `field`
    (default "answer"), else 0; `format`: 1 when the completion matches `pattern`, else 0;
    `length`: 0 up to `target` tokens, falling linearly to -1 at max_completion_length; `python`:
    your own function (`file`, `function`); `code`: runs the completion's Python code with the
    line's `field` (default "tests") appended, in a sandbox (no network, time, memory and process
    limits): 1 when it exits cleanly, else 0."""
    weight: Float = 1.0
    """The reward's weight in the total (the advantage is computed from the weighted sum)."""
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """What logs and plots call it (default: the function's name, or the kind)."""
    extract: Literal["last_number", "regex"] = "last_number"
    """`answer` only: take the completion's last number (compared as numbers: "42", "42.0" and
    "4,2" with thousands separators removed), or the first group of `pattern` (compared as
    stripped strings)."""
    pattern: str | None = None
    """`answer` with extract = "regex": a regular expression whose first group is the answer;
    `format`: the regular expression the whole completion must match (Python's re.fullmatch, with
    DOTALL)."""
    field: str | None = None
    """`answer`: the data field holding the right answer (default "answer"); `code`: the field
    holding the tests to run after the completion's code (default "tests")."""
    target: Int | None = Field(None, ge=1)
    """`length`: completions up to this many tokens are not penalised."""
    file: Path | None = None
    """`python`: the Python file defining the function (relative to the job file's folder)."""
    function: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """`python`: the function's name. It is called as TRL calls reward functions:
    `function(prompts, completions, completion_ids, **fields)` with one list entry per completion
    (`fields`: the prompt lines' other keys, e.g. `answer`, and `step`), and returns one float per
    completion (None: the reward does not apply to that completion)."""
    timeout_seconds: Float = Field(30.0, gt=0, le=3600)
    """Longest a call may take (a `code` reward: each completion's run); beyond it the run stops at
    a clean checkpoint with an error naming the function."""
    memory_mb: Int = Field(512, ge=16, le=1048576)
    """`code`: address space limit of the sandboxed process, in MiB."""
    processes: Int = Field(8, ge=1, le=4096)
    """`code`: how many processes the sandboxed code may have at once (fork bombs stop there)."""

    @model_validator(mode="after")
    def _keys_of_kind(self) -> "RewardConfig":
        needs = {"python": ("file", "function"), "format": ("pattern",)}.get(self.kind, ())
        if self.kind == "answer" and self.extract == "regex":
            needs = ("pattern",)
        missing = [key for key in needs if getattr(self, key) is None]
        if missing:
            raise ValueError(f'kind = "{self.kind}" needs `{missing[0]}`: add it')
        used = {"answer": {"extract", "pattern", "field"}, "format": {"pattern"}, "length": {"target"},
                "python": {"file", "function"}, "code": {"field", "memory_mb", "processes"}}[self.kind]
        for key in ("pattern", "field", "target", "file", "function"):
            if getattr(self, key) is not None and key not in used:
                raise ValueError(f'`{key}` does nothing for kind = "{self.kind}": remove it')
        if self.kind == "answer" and self.extract == "last_number" and self.pattern is not None:
            raise ValueError('`pattern` does nothing with extract = "last_number": remove it, or set extract = "regex"')
        if self.pattern is not None:
            try:
                groups = re.compile(self.pattern).groups
            except re.error as exc:
                raise ValueError(f"pattern {self.pattern!r} is not a valid regular expression ({exc}): fix it") from None
            if self.kind == "answer" and groups < 1:
                raise ValueError(f"pattern {self.pattern!r} has no group: put the answer in parentheses, "
                                 r'e.g. "answer: (\\S+)"')
        return self

    def label(self) -> str:
        """The name this reward is logged under."""
        return self.name or (self.function if self.kind == "python" and self.function else self.kind)
