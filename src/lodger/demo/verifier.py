import re


def number_only(prompts, completions, answer, **kwargs):
    """Half for the right number (the reply's last number), half for replying with a number and nothing else."""
    scores = []
    for completion, truth in zip(completions, answer):
        text = completion[0]["content"].strip()
        numbers = re.findall(r"-?\d+", text)
        right = 0.5 if numbers and numbers[-1] == truth else 0.0
        bare = 0.5 if re.fullmatch(r"-?\d+\.?", text) else 0.0
        scores.append(right + bare)
    return scores
