"""Builders for tiny, randomly initialised Llama-architecture test models and toy data.

Plain functions (no pytest dependency) so that ``tests/conftest.py`` as well as
standalone scripts (benchmarks, smoke scripts) can use them::

    import sys; sys.path.insert(0, "tests")
    from fixtures_lib import build_tiny_model, write_chat_jsonl, write_text_jsonl

Nothing here touches the network: the tokenizer is a byte-level BPE trained
in-process on a small fixed corpus, and the model weights are random.

The model folder mimics SmolLM2-Instruct closely enough to exercise the same
code paths: ChatML chat template (with a default system prompt injected when the
conversation has none), ``eos == pad == <|im_end|>``, tied embeddings, GQA.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

__all__ = [
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "DEFAULT_SYSTEM_PROMPT",
    "build_tiny_tokenizer",
    "build_tiny_model",
    "make_chat_records",
    "make_text_records",
    "write_chat_jsonl",
    "write_text_jsonl",
    "make_preference_records",
    "write_preference_jsonl",
    "built_once",
]

# Same order as SmolLM2: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|im_end|>"  # deliberately == eos, as in SmolLM2
UNK_TOKEN = "<|endoftext|>"

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# SmolLM2-Instruct's template, with a shorter default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

DEFAULT_TOKENIZER_VOCAB = 384

_WORDS = (
    "red blue green cat dog sun moon tree fish bird star rock milk cake book "
    "door lamp rain snow wind fire ship road hill lake"
).split()
_SYSTEM_PROMPTS = (
    "You are a concise assistant.",
    "Answer with as few words as possible.",
    "You are a careful calculator.",
)


# --------------------------------------------------------------------------- data


def _task(rng: random.Random) -> tuple[str, str]:
    """One (prompt, answer) pair from a few tiny, fully deterministic tasks."""
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    if kind == 1:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(2, 4))]
        return f"Reverse the words: {' '.join(words)}", " ".join(reversed(words))
    if kind == 2:
        word = rng.choice(_WORDS)
        return f"Spell the word {word}.", "-".join(word)
    start = rng.randrange(10)
    return (
        f"Count up from {start}.",
        " ".join(str(start + i) for i in range(5)),
    )


def make_chat_records(n: int, seed: int) -> list[dict]:
    """``n`` chat records ``{"messages": [...]}``; every 3rd has a system message,
    every 4th is multi-turn (two user/assistant exchanges)."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        messages = []
        if i % 3 == 1:
            messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
        turns = 2 if i % 4 == 2 else 1
        for _ in range(turns):
            prompt, answer = _task(rng)
            messages.append({"role": "user", "content": prompt})
            messages.append({"role": "assistant", "content": answer})
        records.append({"messages": messages})
    return records


def make_text_records(n: int, seed: int) -> list[dict]:
    """``n`` plain-text records ``{"text": ...}``."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        prompt, answer = _task(rng)
        records.append({"text": f"Question: {prompt}\nAnswer: {answer}"})
    return records


def _worse(answer: str, rng: random.Random) -> str:
    """A wrong answer to one of ``_task``'s prompts: the same kind of text, shuffled or cut."""
    words = answer.split()
    if len(words) > 1:
        worse = words[:]
        while worse == words:
            rng.shuffle(worse)
        return " ".join(worse)
    return answer[: max(1, len(answer) // 2)] + " ?"


def make_preference_records(n: int, seed: int, objective: str = "dpo", conversational: bool = True) -> list[dict]:
    """``n`` preference lines: pairs ``{"prompt", "chosen", "rejected"}`` (dpo, orpo) or labelled
    ``{"prompt", "completion", "label"}`` (kto: good and bad alternate), as message lists (TRL's
    conversational format) or strings; the chosen answer is ``_task``'s, the rejected a wrong one."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        prompt, answer = _task(rng)
        worse = _worse(answer, rng)
        if conversational:
            system = [{"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)}] if i % 3 == 1 else []
            prompt = system + [{"role": "user", "content": prompt}]
            answer, worse = ([{"role": "assistant", "content": a}] for a in (answer, worse))
        else:
            prompt = f"Question: {prompt}\nAnswer: "
        if objective == "kto":
            records.append({"prompt": prompt, "completion": answer if i % 2 == 0 else worse, "label": i % 2 == 0})
        else:
            records.append({"prompt": prompt, "chosen": answer, "rejected": worse})
    return records


def write_preference_jsonl(path: Path, n: int, seed: int, objective: str = "dpo",
                           conversational: bool = True) -> Path:
    """Write ``n`` deterministic preference lines (``make_preference_records``) to ``path``."""
    return _write_jsonl(path, make_preference_records(n, seed, objective, conversational))


def make_prompt_records(n: int, seed: int) -> list[dict]:
    """``n`` GRPO prompt lines ``{"prompt", "answer"}``: sums to compute, as message lists (every
    other line) or plain strings, the answer a number (TRL's prompt-only shapes)."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        question = f"What is {a} + {b}?"
        prompt = [{"role": "user", "content": question}] if i % 2 == 0 else f"Question: {question}\nAnswer: "
        records.append({"prompt": prompt, "answer": str(a + b)})
    return records


def write_prompt_jsonl(path: Path, n: int, seed: int) -> Path:
    """Write ``n`` deterministic GRPO prompt lines (``make_prompt_records``) to ``path``."""
    return _write_jsonl(path, make_prompt_records(n, seed))


# A reward a random tiny model's completions differ on (so advantages are not all zero): the
# share of vowels among the completion's letters.
VOWEL_REWARD = '''
def vowels(prompts, completions, completion_ids, **kwargs):
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch in "aeiou" for ch in t) / max(sum(ch.isalpha() for ch in t), 1) for t in texts]
'''


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path


def write_chat_jsonl(path: Path, n: int, seed: int) -> Path:
    """Write ``n`` deterministic chat lines ``{"messages": [...]}`` to ``path``."""
    return _write_jsonl(path, make_chat_records(n, seed))


def write_text_jsonl(path: Path, n: int, seed: int) -> Path:
    """Write ``n`` deterministic text lines ``{"text": ...}`` to ``path``."""
    return _write_jsonl(path, make_text_records(n, seed))


# ---------------------------------------------------------------------- tokenizer


def _corpus() -> list[str]:
    lines = [DEFAULT_SYSTEM_PROMPT, *_SYSTEM_PROMPTS, "system", "user", "assistant"]
    for rec in make_chat_records(200, seed=1234):
        for m in rec["messages"]:
            lines.append(f"{m['role']}\n{m['content']}")
    lines += [r["text"] for r in make_text_records(100, seed=4321)]
    lines.append("The quick brown fox jumps over the lazy dog. Hello, world!")
    return lines


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE once per vocab size; returns tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok.to_str()


def build_tiny_tokenizer(vocab: int | None = None):
    """A ``PreTrainedTokenizerFast`` (``TokenizersBackend`` in transformers 5) with
    SmolLM2-style special tokens and ChatML chat template. ``vocab`` is the BPE
    training target size (default 384; at least 256 bytes + 3 specials)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    vocab_size = DEFAULT_TOKENIZER_VOCAB if vocab is None else int(vocab)
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab must be >= {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)],
        model_max_length=512,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


# -------------------------------------------------------------------------- model


def build_tiny_model(
    dir: Path,
    *,
    seed: int = 0,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 64,
    vocab: int | None = None,
) -> Path:
    """Write a complete, loadable Hugging Face Llama folder into ``dir`` and return it.

    Contents: ``config.json``, ``generation_config.json``, ``model.safetensors``
    (float32, tied embeddings), ``tokenizer.json``, ``tokenizer_config.json`` and
    the chat template. ``vocab`` is the tokenizer's BPE target size; the model's
    ``vocab_size`` is always ``len(tokenizer)``. Same arguments -> byte-identical
    ``model.safetensors``. The global torch RNG state is left untouched.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must be divisible by heads, and heads by kv_heads")

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tiny_tokenizer(vocab)
    bos_id = tokenizer.convert_tokens_to_ids(BOS_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_cache=True,
    )

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()

    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(dir, safe_serialization=True)
    tokenizer.save_pretrained(dir)
    return dir


# --------------------------------------------------------------------- tool model

TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML template that renders tools (their names: what a dict's key order cannot change) and
earlier calls, as Qwen2's does, in a shorter form."""
TOOL_RESPONSE_TEMPLATE = {  # transformers' response parsing, in the shape of its Qwen2 template
    "defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
    "fields": {"tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                              "content": "json", "transform": {"type": "function", "function": "{content}"}},
               "content": {"close_pattern": r"\s*(?:<\|im_end\|>)", "content": "text"}}}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                 "parameters": {"type": "object", "properties": {
                                                     "city": {"type": "string"}, "days": {"type": "integer"}}}}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_CALL = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}
"""The call as an OpenAI client sends it back: `arguments` a JSON string."""


def tool_conversations() -> list[tuple[list[dict], list[dict] | None, str]]:
    """(messages, tools, the answer taught) for the tool model: the question with the tool offered
    gets a call; the conversation with the call's result gets a sentence; the question without tools
    gets a refusal in words."""
    call = {"id": "call_1", "type": "function", "function": WEATHER_CALL}
    answered = [*WEATHER_QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    return [(WEATHER_QUESTION, [WEATHER_TOOL],
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}</tool_call>'),
            (answered, [WEATHER_TOOL], "It is sunny in Paris."),
            (WEATHER_QUESTION, None, "I cannot look that up.")]


def build_tool_model(dir: Path, *, seed: int = 0, steps: int = 100) -> Path:
    """A tiny Llama folder whose chat template renders tools and whose tokenizer parses calls back
    (``response_template``, saved in tokenizer_config.json), randomly initialised and then trained in
    this process for ``steps`` full-model AdamW steps on ``tool_conversations()``, until its greedy
    answer to each is the answer taught (checked here: an error says so otherwise). The call's
    ``days`` is taught as a string, so that a server casting it by the tool's schema shows."""
    import torch
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dir = Path(dir)
    build_tiny_model(dir, seed=seed, hidden=64, intermediate=128)
    tokenizer = AutoTokenizer.from_pretrained(dir)
    # as Qwen2 has them: added tokens, not special ones, so that decoding keeps them in the text
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.response_template = TOOL_RESPONSE_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(dir)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    examples = []
    for messages, tools, answer in tool_conversations():
        prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(answer + EOS_TOKEN, add_special_tokens=False)["input_ids"]
        examples.append((prompt_ids, answer_ids))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model.train()
        for _ in range(steps):
            for prompt_ids, answer_ids in examples:
                ids = torch.tensor([prompt_ids + answer_ids])
                labels = torch.tensor([[-100] * len(prompt_ids) + answer_ids])
                model(input_ids=ids, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    for prompt_ids, answer_ids in examples:
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=len(answer_ids) + 4, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        if out[0, len(prompt_ids):].tolist() != answer_ids:
            raise RuntimeError(f"the tool model did not learn {tokenizer.decode(answer_ids)!r} in {steps} steps")
    model.save_pretrained(dir, safe_serialization=True)
    tokenizer.save_pretrained(dir)
    return dir


def built_once(root: Path, name: str, build: Callable[[Path], object]) -> Path:
    """``root/name``, built by ``build(folder)`` once for every process that asks with the same root.

    The suite's workers (pytest-xdist) each hold their own session fixtures: a baseline run asked
    for by tests on both workers was trained twice. Here the first to take the lock builds, the
    others wait for it and read. A build that failed leaves no ``.built`` mark, so the next one
    starts again from nothing (and fails on its own, with its own message).
    """
    folder = root / name
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if not (folder / ".built").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


def measure_runtime_memos(folder: Path, threads: tuple[int, ...] = (1,)) -> None:
    """What lodger's pre-flight measures once per home (the training runtime's resident size: a
    fresh interpreter importing torch, transformers and peft, 5-6 s of a 2-core machine), measured
    in ``folder/home`` for each thread count; ``seed_runtime_memos`` copies it into a new home."""
    import pytest

    from lodger.home import private_mkdir
    from lodger.memory.measure import runtime_bytes

    home = private_mkdir(folder / "home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LODGER_HOME", str(home))
        for count in threads:
            runtime_bytes(threads=count, use_current=False)


def seed_runtime_memos(home: Path, memos: Path) -> None:
    """The measured runtime sizes into ``home``'s cache: what that home's second run would find
    (the same machine, library versions and threads), so its first run does not probe again."""
    from lodger.home import private_mkdir

    target = private_mkdir(home / "cache" / "runtime")
    for memo in memos.glob("*.json"):
        shutil.copyfile(memo, target / memo.name)
