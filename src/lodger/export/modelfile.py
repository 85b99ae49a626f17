"""The Ollama Modelfile beside a GGUF export: FROM the file, TEMPLATE as Ollama's Go template, SYSTEM
(the chat template's default system prompt) and PARAMETER stop for the end-of-turn token.

Ollama executes a TEMPLATE that ranges over ``.Messages`` with the conversation, the Modelfile's
SYSTEM put first when the conversation has no system message (template/template.go,
server/routes.go). The ChatML template below renders exactly ``chatml(messages, system)``; it is
written only when the model's own (Jinja) chat template renders the same text for every probe
conversation, so Ollama prompts the model as it was trained. Otherwise the Modelfile has no
TEMPLATE and Ollama falls back to the Jinja template stored in the GGUF (tokenizer.chat_template).
"""

from __future__ import annotations

import re

CHATML_TEMPLATE = ("{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
                   "<|im_start|>assistant\n")
PROBES = ([{"role": "user", "content": "What is 2 + 3?"}],
          [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
          [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
           {"role": "user", "content": "Count to 3."}],
          [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
           {"role": "user", "content": "c"}])
"""Conversations the Jinja template and the ChatML template must render alike (no two consecutive
messages of one role: Ollama would join those, a Jinja template need not)."""
_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>\n", re.S)


def chatml(messages: list[dict], system: str | None) -> str:
    """What CHATML_TEMPLATE renders in Ollama for ``messages`` with the Modelfile's SYSTEM."""
    if system and (not messages or messages[0]["role"] != "system"):
        messages = [{"role": "system", "content": system}, *messages]
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def _render(tokenizer, messages: list[dict]) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template may refuse a probe (e.g. no system role): then it is not ChatML as Ollama runs it
        return None


def chatml_system(tokenizer) -> tuple[bool, str | None]:
    """(the Jinja template renders as ChatML does, its default system prompt or None)."""
    if not getattr(tokenizer, "chat_template", None) or "<|im_start|>" not in tokenizer.chat_template:
        return False, None
    first = _render(tokenizer, PROBES[0]) or ""
    found = _DEFAULT_SYSTEM.match(first)
    system = found.group(1) if found else None
    if system is not None and '"""' in system:
        return False, None  # a SYSTEM value cannot hold the Modelfile's own quote
    return all(_render(tokenizer, probe) == chatml(probe, system) for probe in PROBES), system


def modelfile(gguf_name: str, run_name: str, tokenizer) -> tuple[str, dict]:
    """The Modelfile's text and what it says ({"template": "chatml" | None, "system", "stop"})."""
    is_chatml, system = chatml_system(tokenizer)
    eos = tokenizer.eos_token
    wanted = (eos, "<|im_end|>", "<|im_start|>") if is_chatml else (eos,)
    stop = list(dict.fromkeys(t for t in wanted if t and '"' not in t))
    lines = [f"# Ollama: ollama create {run_name} -f Modelfile && ollama run {run_name}",
             f"FROM ./{gguf_name}"]
    if is_chatml:
        lines.append(f'TEMPLATE """{CHATML_TEMPLATE}"""')
        if system:
            lines.append(f'SYSTEM """{system}"""')
    elif tokenizer.chat_template:
        lines.append("# Not ChatML: Ollama uses the chat template stored in the GGUF (tokenizer.chat_template).")
    lines += [f'PARAMETER stop "{token}"' for token in stop]
    if tokenizer.chat_template:
        lines += ["", "# The model's chat template (Jinja, as trained):"]
        lines += ["# " + line for line in tokenizer.chat_template.splitlines()]
    return "\n".join(lines) + "\n", {"template": "chatml" if is_chatml else None, "system": system, "stop": stop}
