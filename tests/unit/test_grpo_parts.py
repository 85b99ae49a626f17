"""GRPO's parts on their own: the job's [grpo] and [[rewards]] checks, prompt lines, the built-in
rewards, the reward host (a real child process: errors, bad values, time limits) and the sandbox
that runs code a model wrote."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from lodger.errors import DataError, JobFileError, RewardError


def _job(tmp_path: Path, extra: str = "", rewards: str = '[[rewards]]\nkind = "answer"\n', method: str = "grpo") -> Path:
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    path = tmp_path / "job.toml"
    path.write_text(f'[method]\nobjective = "{method}"\n[data]\ntrain = "p.jsonl"\n[training]\nsteps = 2\n{extra}\n'
                    f"{rewards}")
    return path


def _problems(path: Path) -> str:
    from lodger.lifecycle.jobfile import load_job

    with pytest.raises(JobFileError) as caught:
        load_job(path)
    return str(caught.value)


def test_grpo_job_checks_name_the_key_the_value_and_the_fix(tmp_path):
    text = _problems(_job(tmp_path, "[grpo]\nnum_generations = 1\n"))
    assert "[grpo] num_generations = 1" in text and "larger" in text
    text = _problems(_job(tmp_path, "packing = true\n[grpo]\n"))
    assert "packing = true" in text and "GRPO" in text.upper()
    text = _problems(_job(tmp_path, rewards=""))
    assert "needs at least one [[rewards]]" in text
    text = _problems(_job(tmp_path, method="sft"))
    assert "[[rewards]] is used only with" in text
    text = _problems(_job(tmp_path, rewards='[[rewards]]\nkind = "answer"\nextract = "regex"\npattern = "no group"\n'))
    assert "has no group" in text
    text = _problems(_job(tmp_path, rewards='[[rewards]]\nkind = "format"\npattern = "(unclosed"\n'))
    assert "not a valid regular expression" in text
    text = _problems(_job(tmp_path, rewards='[[rewards]]\nkind = "python"\nfile = "missing.py"\nfunction = "f"\n'))
    assert "missing.py" in text and "no such file" in text
    text = _problems(_job(tmp_path, rewards='[[rewards]]\nkind = "answer"\n[[rewards]]\nkind = "answer"\n'))
    assert "two rewards are named 'answer'" in text
    text = _problems(_job(tmp_path, "world_size = 2\n[grpo]\nnum_iterations = 2\n"))
    assert "num_iterations > 1 with [training] world_size > 1" in text
    text = _problems(_job(tmp_path, rewards='[[rewards]]\nkind = "length"\ntarget = 999\n'))
    assert "never penalises" in text


def test_prompt_lines_are_checked_and_named(tmp_path):
    from lodger.data.chats import read_jsonl
    from lodger.data.prompts import check_row

    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "fine", "answer": 1}),
        json.dumps({"question": "no prompt"}),
        json.dumps({"prompt": "  "}),
        json.dumps({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}),
        json.dumps({"prompt": "x", "completions": "reserved"}),
        json.dumps({"messages": [{"role": "user", "content": "sft line"}]}),
    ]) + "\n")
    with pytest.raises(DataError) as caught:
        read_jsonl(path, check_row)
    text = str(caught.value)
    assert "5 bad line(s)" in text
    for line, why in ((2, 'missing "prompt"'), (3, '"prompt" is empty'), (4, "end with a user message"),
                      (5, "a name the reward call uses itself"), (6, "supervised line")):
        assert f"{path}:{line}: " in text and why in text, (line, why, text)


def test_a_prompt_over_max_length_is_refused_with_its_line(tmp_path, tiny_model_dir):
    from lodger.data.chats import read_jsonl
    from lodger.model import load_tokenizer
    from lodger.data.prompts import check_row, tokenize_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "short"}) + "\n" + json.dumps({"prompt": "word " * 80}) + "\n")
    with pytest.raises(DataError) as caught:
        tokenize_prompts(read_jsonl(path, check_row), load_tokenizer(tiny_model_dir), "sha", 16)
    assert "1 of 2 prompt(s) are longer than [data] max_length = 16" in str(caught.value)
    assert "lines 2 (" in str(caught.value)


def test_builtin_rewards_compare_answers_formats_and_lengths():
    from lodger.rewards.builtin import last_number, make

    assert last_number("so it is 1,234.5 apples") == 1234.5 and last_number("none") is None
    answer = make({"kind": "answer", "extract": "last_number", "field": None})
    assert answer(["q"] * 3, ["= 42", [{"role": "assistant", "content": "42.0"}], "41"],
                  answer=["42", "42", "42"]) == [1.0, 1.0, 0.0]
    regex = make({"kind": "answer", "extract": "regex", "pattern": r"<a>(.*?)</a>", "field": "gold"})
    assert regex(["q", "q"], ["<a> yes </a>", "yes"], gold=["yes", "yes"]) == [1.0, 0.0]
    form = make({"kind": "format", "pattern": r"<think>.*</think>\s*\d+"})
    assert form(["q", "q"], ["<think>a\nb</think> 7", "7"]) == [1.0, 0.0]
    length = make({"kind": "length", "target": 4, "max_completion_length": 8})
    assert length(["q"] * 3, ["", "", ""], completion_ids=[[1] * 3, [1] * 6, [1] * 20]) == [0.0, -0.5, -1.0]


def _rewards(tmp_path: Path, source: str, function: str = "f", timeout: float = 30.0, kind: str = "python", **keys):
    from lodger.config.grpo import GRPOConfig, RewardConfig
    from lodger.rewards import Rewards

    file = tmp_path / "r.py"
    file.write_text(source)
    spec = dict(kind=kind, timeout_seconds=timeout, **keys)
    if kind == "python":
        spec.update(file=file, function=function)
    return Rewards([RewardConfig(**spec)], GRPOConfig())


def _score(rewards, n: int = 2, step: int = 4):
    return rewards.score(["p"] * n, ["c"] * n, [[1]] * n, {"answer": ["1"] * n}, [10 + k for k in range(n)], step)


def test_owner_reward_problems_are_named_before_training(tmp_path):
    cases = (("def g(prompts, completions, **kw):\n    return []\n", "f", "defines no `f` (its functions: g)"),
             ("def f(prompts, completions):\n    return []\n", "f", "must accept **kwargs"),
             ("raise RuntimeError('at import')\n", "f", "raised while being imported"))
    for source, function, why in cases:
        rewards = _rewards(tmp_path, source, function)
        with pytest.raises(JobFileError) as caught:
            rewards.check()
        assert why in str(caught.value), str(caught.value)
        rewards.close()


def test_a_failing_reward_names_the_function_the_step_and_the_prompt_line(tmp_path):
    cases = [
        ("def f(prompts, completions, **kw):\n    raise ValueError('boom')\n", "ValueError: boom (at r.py:2)"),
        ("def f(prompts, completions, **kw):\n    return [1.0, float('nan')]\n", "line 11: returned nan"),
        ("def f(prompts, completions, **kw):\n    return [1.0]\n", "returned 1 values for 2 completions"),
        ("def f(prompts, completions, **kw):\n    return [1.0, 'x']\n", "returned 'x' (str), not a number"),
        ("def f(prompts, completions, **kw):\n    return [1.0 if c != 'c' else 1/0 for c in completions][:1] + [1/0]\n",
         "ZeroDivisionError"),
    ]
    for source, why in cases:
        rewards = _rewards(tmp_path, source)
        with pytest.raises(RewardError) as caught:
            _score(rewards)
        text = str(caught.value)
        assert "reward 'f' (`f` in" in text and "at step 5" in text and why in text, text
        assert "resume" in text
        rewards.close()


def test_a_reward_past_its_time_limit_is_killed_and_named(tmp_path):
    rewards = _rewards(tmp_path, "def f(prompts, completions, **kw):\n    while True:\n        pass\n", timeout=0.5)
    began = time.monotonic()
    with pytest.raises(RewardError) as caught:
        _score(rewards)
    assert time.monotonic() - began < 10
    assert "took longer than its limit of 0.5 s" in str(caught.value)
    host = rewards.host.proc if rewards.host else None
    assert host is None or host.poll() is not None  # the runaway process is gone
    # a catastrophic regex backtracks inside C, where no signal reaches: the child is killed all the same
    regex = _rewards(tmp_path, "", kind="format", pattern=r"(a+)+$", timeout=0.5)
    with pytest.raises(RewardError) as caught:
        regex.score(["p"], ["a" * 40 + "b"], [[1]], {}, [3], 0)
    assert "reward 'format' (the format reward)" in str(caught.value)


def test_none_means_the_reward_does_not_apply_and_prints_do_not_break_the_channel(tmp_path):
    rewards = _rewards(tmp_path, "def f(prompts, completions, step, **kw):\n    print('noise', step)\n"
                                 "    return [None, 0.25]\n")
    table = _score(rewards)
    rewards.close()
    assert table[0][0] != table[0][0] and table[1][0] == 0.25  # NaN, then the value


def test_sandboxed_code_has_no_network_no_room_and_no_time(tmp_path):
    from lodger.rewards.sandbox import run_python

    ok = run_python("print(sum(range(10)))", timeout=10)
    assert ok.ok and ok.stdout.strip() == "45"
    net = run_python("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=3)", timeout=10)
    assert not net.ok and ("unreachable" in net.stderr or "OSError" in net.stderr), net.stderr
    slow = run_python("while True:\n    pass", timeout=1)
    assert slow.timed_out and not slow.ok
    hog = run_python("x = bytearray(400 * 2**20)", timeout=10, memory_mb=64)
    assert not hog.ok and "MemoryError" in hog.stderr, hog.stderr
    forks = run_python("import os\nfor _ in range(40):\n    os.fork()\n", timeout=10, processes=4)
    assert not forks.ok and ("BlockingIOError" in forks.stderr or "Resource temporarily" in forks.stderr), forks.stderr
    # the whole file system is read-only to it (/tmp included, which anyone may write), its own folder not
    planted = Path("/tmp") / f"lodger-planted-{tmp_path.name}"
    outside = run_python(f"open({str(planted)!r}, 'w').write('x')", timeout=10)
    assert not outside.ok and "Read-only file system" in outside.stderr and not planted.exists(), outside.stderr
    inside = run_python("open('scratch', 'w').write('x')\nprint(open('scratch').read())", timeout=10)
    assert inside.ok and inside.stdout.strip() == "x", inside.stderr


def test_the_code_reward_runs_the_completions_program_with_the_lines_tests(tmp_path):
    rewards = _rewards(tmp_path, "", kind="code", timeout=5)
    table = rewards.score(["p", "p"], ["```python\ndef add(a, b):\n    return a + b\n```", "def add(a, b): return a - b"],
                          [[1], [1]], {"tests": ["assert add(2, 3) == 5"] * 2}, [1, 2], 0)
    rewards.close()
    assert [row[0] for row in table] == [1.0, 0.0]


def test_the_decode_loop_matches_transformers_generate_and_the_losss_layout(tiny_model_dir):
    """Greedy completions of prompts of different lengths (left-padded, positions counted per row)
    equal transformers' ``generate``'s; and on the loss's right-padded layout every one of those
    tokens is again the most likely one at its position (the same distributions, so a batch
    trained once starts at ratio 1). Sampling with top-k and top-p draws only allowed tokens."""
    import torch
    from transformers import GenerationConfig

    from lodger.config import MethodConfig
    from lodger.model import attach_method, load_base_model, load_tokenizer
    from lodger.train.grpo import token_logps
    from lodger.train.precision import Precision
    from lodger.train.rollout import Sampling, layout, sample

    tokenizer = load_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    model = attach_method(load_base_model(tiny_model_dir), MethodConfig(rank=4, alpha=8.0), 0)
    prompts = [tokenizer("What is 2 + 3?")["input_ids"], tokenizer("Count up from 4, then stop.")["input_ids"],
               tokenizer("Hi")["input_ids"]]
    ends, pad, fp32 = frozenset({tokenizer.eos_token_id}), tokenizer.pad_token_id, Precision("fp32", "cpu")
    ours = sample(model, prompts, sampling=Sampling(12, ends, greedy=True), pad_id=pad, precision=fp32, device="cpu")
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    model.eval()
    theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(
        do_sample=False, max_new_tokens=12, eos_token_id=[tokenizer.eos_token_id], pad_token_id=pad))
    for row, completion in zip(theirs[:, width:].tolist(), ours):
        assert row[:len(completion)] == completion

    tensors = layout(prompts, ours, pad, False, 12, set(ends))
    with torch.no_grad():
        logits = model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits
    for r, (prompt, completion) in enumerate(zip(prompts, ours)):
        best = logits[r, len(prompt) - 1:len(prompt) - 1 + len(completion)].argmax(-1).tolist()
        assert best == completion

    torch.manual_seed(1)
    top = Sampling(12, ends, temperature=0.8, top_k=5, top_p=0.9)
    sampled = sample(model, prompts, sampling=top, pad_id=pad, precision=fp32, device="cpu")
    tensors = layout(prompts, sampled, pad, False, 12, set(ends))
    with torch.no_grad():
        logits = model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits
        assert bool(torch.isfinite(token_logps(model, tensors, 0.8)[tensors["mask"] > 0]).all())
    for r, (prompt, completion) in enumerate(zip(prompts, sampled)):
        for k, token in enumerate(completion):
            allowed = logits[r, len(prompt) - 1 + k].topk(5).indices.tolist()
            assert token in allowed, (r, k, token, allowed)


def test_init_writes_a_grpo_job_that_loads_with_its_prompts_and_verifier(tmp_path):
    from click.testing import CliRunner

    from lodger.cli.main import cli
    from lodger.data.chats import read_jsonl
    from lodger.lifecycle.jobfile import load_job
    from lodger.data.prompts import check_row

    result = CliRunner().invoke(cli, ["init", str(tmp_path / "grpo.toml"), "--objective", "grpo"])
    assert result.exit_code == 0, result.output
    job = load_job(tmp_path / "grpo.toml")
    assert job.method.objective == "grpo" and job.grpo.num_generations >= 2
    assert [r.label() for r in job.rewards] == ["right_number", "bare"]
    assert job.rewards[0].file == tmp_path / "verifier.py"
    rows = read_jsonl(job.data.train, check_row).rows
    assert len(rows) == 256 and all("answer" in r for r in rows)
    from lodger.rewards import Rewards

    rewards = Rewards(job.rewards, job.grpo)
    truth = rows[0]["answer"]
    said = [[{"role": "assistant", "content": text}] for text in (truth, f"It is {truth}", "no idea", "-1000")]
    table = rewards.score([rows[0]["prompt"]] * 4, said, [[1]] * 4, {"answer": [truth] * 4}, [1] * 4, 0)
    rewards.close()
    assert table == [[1.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.0, 1.0]]  # right and bare, right, neither, bare
