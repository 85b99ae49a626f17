"""`tools`: offered to the model through its own chat template, and its calls parsed back by the
tokenizer's `response_template` (transformers' response parsing), or refused with a 400 naming `tools`.

A template that does not render `tools` (SmolLM2's, the tiny test model's) would answer as if no tool
had been offered, and a model whose calls cannot be parsed back would answer with call syntax as
text: both are refused rather than answered wrongly.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from .schema import ApiError

LOG = logging.getLogger("lodger.serve")
PROBE: dict[str, Any] = {"type": "function", "function": {"name": "lodger_probe_tool_x7", "description": "probe",
                                          "parameters": {"type": "object", "properties": {}}}}


def unsupported(engine) -> str | None:
    """Why this model cannot take tools, or None when it can."""
    conversation = [{"role": "user", "content": "hello"}]
    try:
        rendered = engine.chat_text(conversation, [PROBE])
    except Exception as exc:  # noqa: BLE001 (a template that raises on tools does not take them)
        return f"the model's chat template fails with tools ({type(exc).__name__}: {exc})"
    if PROBE["function"]["name"] not in rendered:
        return "the model's chat template does not render `tools`, so the model would never see them"
    template = getattr(engine.tokenizer, "response_template", None)
    if not isinstance(template, dict) or "tool_calls" not in template.get("fields", {}):
        return ("the model's chat template renders `tools`, but its tokenizer has no `response_template` with "
                "`tool_calls`, so its calls could not be parsed back")
    return None


def offered(engine, body) -> list[dict] | None:
    """The tool definitions to render for a chat request (None: no tools); ApiError 400 naming the
    field for a definition whose `parameters` do not compile, or when the model cannot take tools."""
    from .structured import compile_schema

    for i, tool in enumerate(body.tools or []):
        if tool.function.parameters is not None:  # as OpenAI checks them
            compile_schema(tool.function.parameters, f"tools.{i}.function.parameters")
    uses_tools = any(m.role == "tool" or m.tool_calls for m in body.messages)
    if not body.tools and not uses_tools:
        return None
    reason = unsupported(engine)
    if reason is not None:
        param = "tools" if body.tools else "messages"
        raise ApiError(400, f"`{param}`: tools are not supported with this model: {reason}", param=param,
                       code="unsupported_parameter")
    choice = body.tool_choice
    if choice is not None and choice not in ("auto", "none"):
        raise ApiError(400, "tool_choice: only `auto` and `none` are supported (forcing a call would need the "
                       "template's call format as a grammar)", param="tool_choice", code="unsupported_parameter")
    if not body.tools or choice == "none":
        return None
    return [tool.model_dump(exclude_none=True) for tool in body.tools]


def parse_calls(engine, text: str, prompt_text: str, tools: list[dict]) -> tuple[str | None, list[dict] | None]:
    """(content, tool calls in OpenAI's shape) of a generated answer. An answer the parser cannot read,
    or a call to a tool that was not offered, stays text."""
    try:
        parsed = engine.tokenizer.parse_response(text, prefix=prompt_text, tools=tools)
    except Exception as exc:  # noqa: BLE001 (the model wrote something the template does not parse)
        LOG.info("the answer did not parse as a message (%s: %s); answered as text", type(exc).__name__, exc)
        return text, None
    names = {t["function"]["name"] for t in tools}
    calls = []
    for call in parsed.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        name, arguments = function.get("name"), function.get("arguments", {})
        if name not in names:
            LOG.info("the answer calls `%s`, which was not offered; answered as text", name)
            return text, None
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name,
                                   "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
    if not calls:
        return text, None
    return (parsed.get("content") or None), calls


__all__ = ["offered", "parse_calls", "unsupported"]
