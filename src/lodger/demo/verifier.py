import re


def right_number(prompts, completions, answer, **kwargs):
    """1 when the reply's last number is the line's answer, else 0 (TRL's reward signature)."""
    scores = []
    for completion, truth in zip(completions, answer):
        numbers = re.findall(r"-?\d+", completion[0]["content"])
        scores.append(1.0 if numbers and numbers[-1] == truth else 0.0)
    return scores
