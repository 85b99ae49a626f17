"""Ollama's Modelfile grammar, ported from Go to check the Modelfiles lodger writes.

Source: github.com/ollama/ollama at commit fb30760996871fa9460115c753afd2c60d4ab0f7 (2026-08-21):
- ``parser/parser.go``: ``ParseFile`` (the rune-by-rune state machine, ``parseRuneForState``,
  ``unquote``, ``isValidCommand``, ``isValidMessageRole``), the command names (``FROM`` -> "model")
  and ``Modelfile.CreateRequest``'s handling of each command;
- ``api/types.go``: ``FormatParams`` and the ``Options``/``Runner`` fields a ``PARAMETER`` may set,
  with their Go kinds (``stop`` is the one string slice: each ``PARAMETER stop`` line adds one);
- ``template/template.go`` and ``server/routes.go``: what a ``TEMPLATE`` that ranges over
  ``.Messages`` is executed with (the Modelfile's ``SYSTEM`` prepended as a system message when the
  conversation has none; consecutive messages of one role collated with a blank line).

``parse_file`` follows the Go code line for line (same states, same transitions, same errors), so a
file it accepts is one ``ollama create`` parses the same way. ``create_request`` ports the parts of
``CreateRequest`` that need no file digests or network. ``render_template`` executes the small
subset of Go's text/template that a ChatML Modelfile needs (text, ``{{ .Field }}``, ``range``/``end``
over ``.Messages``, ``if``/``else``/``end`` on a field, ``{{-``/``-}}`` trimming) and refuses any
other action, so a template it cannot read fails the test instead of passing unread.
"""

from __future__ import annotations

import os
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

# parser.go's states
NIL, NAME, VALUE, PARAMETER, MESSAGE, COMMENT = range(6)

ERR_MISSING_FROM = "no FROM line"
ERR_INVALID_ROLE = 'message role must be one of "system", "user", or "assistant"'
ERR_INVALID_COMMAND = ('command must be one of "from", "license", "template", "system", "adapter", "draft", '
                       '"renderer", "parser", "parameter", "message", or "requires"')
COMMANDS = ("from", "license", "template", "system", "adapter", "draft", "renderer", "parser", "parameter",
            "message", "requires")

# api/types.go: Options and the embedded Runner, json tag -> Go kind ("*int"/"*bool": pointers).
PARAMETERS = {
    "num_ctx": "int", "num_batch": "int", "num_gpu": "int", "main_gpu": "*int", "use_mmap": "*bool",
    "num_thread": "int", "draft_num_predict": "int",
    "num_keep": "int", "seed": "int", "num_predict": "int", "top_k": "int", "top_p": "float32",
    "min_p": "float32", "typical_p": "float32", "repeat_last_n": "int", "temperature": "float32",
    "repeat_penalty": "float32", "presence_penalty": "float32", "frequency_penalty": "float32",
    "stop": "[]string",
}
DEPRECATED = ("penalize_newline", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mlock", "mirostat",
              "mirostat_tau", "mirostat_eta")


class ModelfileError(Exception):
    """What Ollama's parser would return: ``kind`` is "unexpected_eof", "invalid_command",
    "invalid_role", "missing_from" or "request" (a CreateRequest error)."""

    def __init__(self, kind: str, message: str, line: int = 0):
        self.kind, self.line = kind, line
        super().__init__(f"(line {line}): {message}" if line > 0 else message)


@dataclass(frozen=True)
class Command:
    name: str
    args: str


def _is_alpha(r: str) -> bool:
    return "a" <= r <= "z" or "A" <= r <= "Z"


def _is_number(r: str) -> bool:
    return "0" <= r <= "9"


def _is_space(r: str) -> bool:
    return r in (" ", "\t")


def _is_newline(r: str) -> bool:
    return r in ("\r", "\n")


def _is_print(r: str) -> bool:
    """Go's strconv.IsPrint: categories L, M, N, P, S and the ASCII space."""
    return r == " " or unicodedata.category(r)[0] in "LMNPS"


_GO_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
            "\u2028\u2029\u202f\u205f\u3000"


def _trim_space(s: str) -> str:
    """Go's strings.TrimSpace (unicode.IsSpace), which is not quite Python's str.strip."""
    return s.strip(_GO_SPACE)


def _unquote(s: str) -> tuple[str, bool]:
    if len(s) >= 3 and s[:3] == '"""':
        if len(s) >= 6 and s[-3:] == '"""':
            return s[3:-3], True
        return "", False
    if len(s) >= 1 and s[0] == '"':
        if len(s) >= 2 and s[-1] == '"':
            return s[1:-1], True
        return "", False
    return s, True


def _parse_rune_for_state(r: str, cs: int) -> tuple[int, str]:
    """parseRuneForState: the next state and the rune to keep ("\\0": none). Raises as Go returns errors."""
    if cs == NIL:
        if r == "#":
            return COMMENT, "\0"
        if _is_space(r) or _is_newline(r):
            return NIL, "\0"
        return NAME, r
    if cs == NAME:
        if _is_alpha(r):
            return NAME, r
        if _is_space(r):
            return VALUE, "\0"
        raise ModelfileError("invalid_command", ERR_INVALID_COMMAND)
    if cs == VALUE:
        if _is_newline(r) or _is_space(r):
            return NIL, r
        return VALUE, r
    if cs == PARAMETER:
        if _is_alpha(r) or _is_number(r) or r == "_":
            return PARAMETER, r
        if _is_space(r):
            return VALUE, "\0"
        raise ModelfileError("unexpected_eof", "unexpected EOF")
    if cs == MESSAGE:
        if _is_alpha(r):
            return MESSAGE, r
        if _is_space(r):
            return VALUE, "\0"
        raise ModelfileError("unexpected_eof", "unexpected EOF")
    if cs == COMMENT:
        return (NIL, "\0") if _is_newline(r) else (COMMENT, "\0")
    raise ModelfileError("unexpected_eof", "")


def decode(data: bytes) -> str:
    """unicode.BOMOverride(unicode.UTF8.NewDecoder()): a UTF-16 BOM switches to UTF-16, a UTF-8 BOM is dropped."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return data.decode("utf-16")
    return data.removeprefix(b"\xef\xbb\xbf").decode("utf-8", errors="replace")


def parse_file(text: str | bytes) -> list[Command]:
    """ParseFile: the Modelfile's commands, in order; raises ModelfileError where Ollama's parser errs."""
    if isinstance(text, bytes):
        text = decode(text)
    commands: list[Command] = []
    name, curr, line, role = "", NIL, 1, ""
    buf: list[str] = []
    for r in text:
        if _is_newline(r):
            line += 1
        try:
            nxt, r = _parse_rune_for_state(r, curr)
        except ModelfileError as exc:
            if exc.kind == "unexpected_eof":
                raise ModelfileError("unexpected_eof", f"unexpected EOF: {''.join(buf)}") from None
            raise ModelfileError(exc.kind, str(exc), line) from None
        if nxt != curr:
            if curr == NAME:
                word = "".join(buf)
                if word.lower() not in COMMANDS:
                    raise ModelfileError("invalid_command", ERR_INVALID_COMMAND, line)
                s = word.lower()
                if s == "from":
                    name = "model"
                elif s == "parameter":
                    nxt = PARAMETER
                elif s == "message":
                    nxt, name = MESSAGE, s
                else:
                    name = s
            elif curr == PARAMETER:
                name = "".join(buf)
            elif curr == MESSAGE:
                if "".join(buf) not in ("system", "user", "assistant"):
                    raise ModelfileError("invalid_role", ERR_INVALID_ROLE, line)
                role = "".join(buf)
            elif curr == VALUE:
                s, ok = _unquote(_trim_space("".join(buf)))
                if not ok or _is_space(r):
                    buf.append(r)
                    continue
                if role:
                    s, role = f"{role}: {s}", ""
                commands.append(Command(name, s))
            buf = []
            curr = nxt
        if r != "\0" and _is_print(r):
            buf.append(r)
    if curr == VALUE:
        s, ok = _unquote(_trim_space("".join(buf)))
        if not ok:
            raise ModelfileError("unexpected_eof", "unexpected EOF")
        commands.append(Command(name, f"{role}: {s}" if role else s))
    elif curr not in (COMMENT, NIL):
        raise ModelfileError("unexpected_eof", "unexpected EOF")
    if not any(c.name == "model" for c in commands):
        raise ModelfileError("missing_from", ERR_MISSING_FROM)
    return commands


def _go_int(value: str) -> int:
    if not re.fullmatch(r"[+-]?[0-9]+", value):
        raise ValueError(value)
    return int(value)


def _go_bool(value: str) -> bool:
    table = {"1": True, "t": True, "T": True, "TRUE": True, "true": True, "True": True,
             "0": False, "f": False, "F": False, "FALSE": False, "false": False, "False": False}
    return table[value]


def _format_param(key: str, value: str):
    """FormatParams for one PARAMETER line."""
    kind = PARAMETERS.get(key)
    if kind is None:
        raise ModelfileError("request", f"unknown parameter '{key}'")
    try:
        if kind in ("int", "*int"):
            return _go_int(value)
        if kind == "float32":
            return float(value)
        if kind == "*bool":
            return _go_bool(value)
    except (ValueError, KeyError):
        raise ModelfileError("request", f"invalid {kind.lstrip('*').removesuffix('32')} value [{value}]") from None
    return [value] if kind == "[]string" else value


def expand_path(path: str, relative_dir: Path) -> Path:
    """expandPathImpl: absolute, ~ or ~user, else relative to the Modelfile's folder."""
    if os.path.isabs(path) or path.startswith(("\\", "/")):
        return Path(os.path.abspath(path))
    if path.startswith("~"):
        return Path(os.path.abspath(os.path.expanduser(path)))
    return Path(os.path.abspath(os.path.join(relative_dir, path)))


@dataclass
class CreateRequest:
    """The parts of api.CreateRequest a Modelfile sets (files by path instead of digest)."""

    from_name: str | None = None       # FROM naming a model (no such local path)
    files: list[Path] = field(default_factory=list)   # FROM naming a local file
    template: str | None = None
    system: str | None = None
    parameters: dict = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)
    license: list[str] = field(default_factory=list)
    adapters: list[Path] = field(default_factory=list)


def create_request(commands: list[Command], relative_dir: Path) -> CreateRequest:
    """Modelfile.CreateRequest without the digests: a FROM path that does not exist becomes a model name."""
    req = CreateRequest()
    for c in commands:
        if c.name == "model":
            path = expand_path(c.args, relative_dir)
            if path.exists():
                req.files.append(path)
            else:
                req.from_name = c.args
        elif c.name == "adapter":
            req.adapters.append(expand_path(c.args, relative_dir))
        elif c.name == "template":
            req.template = c.args
        elif c.name == "system":
            req.system = c.args
        elif c.name == "license":
            req.license.append(c.args)
        elif c.name == "message":
            role, _, content = c.args.partition(": ")
            req.messages.append({"role": role, "content": content})
        elif c.name in ("draft", "renderer", "parser", "requires"):
            continue
        elif c.name in DEPRECATED:
            continue  # Ollama prints "warning: parameter ... is deprecated" and ignores it
        else:
            value = _format_param(c.name, c.args)
            if isinstance(value, list) and isinstance(req.parameters.get(c.name), list):
                req.parameters[c.name] += value
            else:
                req.parameters[c.name] = value
    return req


# ---------------------------------------------------------------------------------- templates

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)


def _tokens(template: str) -> list[tuple[str, str]]:
    """("text", s) and ("action", body), with Go's trim markers applied to the neighbouring text."""
    out: list[tuple[str, str]] = []
    pos = 0
    trim_next = False
    for m in _ACTION.finditer(template):
        text = template[pos:m.start()]
        if trim_next:
            text = text.lstrip(" \t\r\n")
        if m.group(1):
            text = text.rstrip(" \t\r\n")
        out.append(("text", text))
        out.append(("action", m.group(2).strip()))
        trim_next = bool(m.group(3))
        pos = m.end()
    tail = template[pos:]
    out.append(("text", tail.lstrip(" \t\r\n") if trim_next else tail))
    return out


def _parse(tokens: list[tuple[str, str]], i: int, stop: tuple[str, ...]) -> tuple[list, int, str | None]:
    nodes: list = []
    while i < len(tokens):
        kind, value = tokens[i]
        i += 1
        if kind == "text":
            nodes.append(("text", value))
        elif value in stop:
            return nodes, i, value
        elif m := re.fullmatch(r"range \.(\w+)", value):
            body, i, ended = _parse(tokens, i, ("end",))
            if ended != "end":
                raise ModelfileError("request", "template: unexpected EOF in range")
            nodes.append(("range", m.group(1), body))
        elif m := re.fullmatch(r"if \.(\w+)", value):
            body, i, ended = _parse(tokens, i, ("end", "else"))
            other: list = []
            if ended == "else":
                other, i, ended = _parse(tokens, i, ("end",))
            if ended != "end":
                raise ModelfileError("request", "template: unexpected EOF in if")
            nodes.append(("if", m.group(1), body, other))
        elif m := re.fullmatch(r"\.(\w+)", value):
            nodes.append(("field", m.group(1)))
        else:
            raise ModelfileError("request", f"template action {{{{ {value} }}}} is outside the subset this check reads")
    return nodes, i, None


def _execute(nodes: list, dot: dict) -> str:
    out = []
    for node in nodes:
        if node[0] == "text":
            out.append(node[1])
        elif node[0] == "field":
            if node[1] not in dot:
                raise ModelfileError("request", f"template: can't evaluate field {node[1]}")
            out.append(str(dot[node[1]]))
        elif node[0] == "range":
            for item in dot.get(node[1]) or []:
                out.append(_execute(node[2], item))
        else:
            out.append(_execute(node[2] if dot.get(node[1]) else node[3], dot))
    return "".join(out)


def render_template(template: str, messages: list[dict], system: str | None) -> str:
    """What Ollama sends the model for ``messages`` (a chat request) with this TEMPLATE and SYSTEM."""
    msgs = [dict(m) for m in messages]
    if system and (not msgs or msgs[0]["role"] != "system"):
        msgs.insert(0, {"role": "system", "content": system})
    collated: list[dict] = []
    for m in msgs:  # template.go's collate
        if collated and collated[-1]["role"] == m["role"] and m["role"] != "tool":
            collated[-1]["content"] += "\n\n" + m["content"]
        else:
            collated.append(m)
    nodes, _, _ = _parse(_tokens(template), 0, ())
    dot = {"System": "\n\n".join(m["content"] for m in collated if m["role"] == "system"),
           "Messages": [{"Role": m["role"], "Content": m["content"]} for m in collated], "Response": ""}
    return _execute(nodes, dot)
