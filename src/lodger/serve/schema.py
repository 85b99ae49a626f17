"""The request bodies the server accepts, as OpenAI's clients send them, and its error type.

No field is dropped silently: a field is supported, refused with a 400 naming it (``REFUSED``: what
this server cannot do, unless the value asks for nothing), or accepted and ignored because it cannot
change the answer (``IGNORED``, listed in docs/serve.md); any other field is a 400 naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Refused:
    """A field this server cannot honour: a 400 naming it, unless its value is one of ``harmless``."""

    reason: str
    harmless: tuple = (None,)


TEXT_ONLY = "this server serves a text-only model"
REFUSED_CHAT = {
    "audio": Refused(f"audio output is not supported: {TEXT_ONLY}"),
    "modalities": Refused(f"only [\"text\"] is supported: {TEXT_ONLY}", (None, ["text"])),
    "functions": Refused("the deprecated `functions` are not supported: send `tools`"),
    "function_call": Refused("the deprecated `function_call` is not supported: send `tool_choice`"),
    "reasoning_effort": Refused("the served models do not reason in a separate channel"),
    "verbosity": Refused("the served models have no verbosity setting"),
    "web_search_options": Refused("this server cannot search the web"),
    "moderation": Refused("this server has no moderation"),
    "store": Refused("this server stores no completions", (None, False)),
}
REFUSED_COMPLETION = {
    "suffix": Refused("the served models have no fill-in-the-middle format", (None, "")),
    "best_of": Refused("best_of above 1 is not supported: send separate requests", (None, 1)),
}
#: Accepted and never read: they name the caller or tune OpenAI's own service, never the answer.
IGNORED_CHAT = ("user", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",
                "prompt_cache_retention", "prompt_cache_options", "prediction")
IGNORED_COMPLETION = ("user",)


def refusal(raw: dict, table: dict[str, Refused]) -> ApiError | None:
    """The 400 for the first refused field of a request body that asks for something, else None."""
    for name, rule in table.items():
        if name in raw and raw[name] not in rule.harmless:
            return ApiError(400, f"`{name}` is not supported: {rule.reason}", param=name,
                            code="unsupported_parameter")
    return None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class OtherPart(BaseModel):
    """Any part that is not text (image_url, input_audio, file, ...): named in a clear 400."""

    model_config = ConfigDict(extra="allow")
    type: str


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    """An earlier assistant turn's call, handed back to the chat template."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None          # handed to the chat template, which may use it or not
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None       # an earlier assistant turn's refusal text: not shown to the model

    @field_validator("content")
    @classmethod
    def _text_only(cls, content):
        if isinstance(content, list):
            other = next((p.type for p in content if not isinstance(p, TextPart)), None)
            if other == "text":
                raise ValueError("a part of type `text` needs a string `text` (and nothing else)")
            if other is not None:
                raise ValueError(f"content parts of type `{other}` are not supported: {TEXT_ONLY}; send text "
                                 "parts (or a string) only")
        return content

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("`content` is required (only an assistant message with `tool_calls` may omit it)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a `tool` message needs the `tool_call_id` it answers")
        return self

    def as_template(self) -> dict:
        """The message as a chat template takes it: one string (text parts joined, as OpenAI does)."""
        # no content (an assistant turn of calls only) as "": templates join content to strings
        # (``_text_only`` let text parts only through)
        text = self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content or [] if isinstance(p, TextPart))
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding against side channels: none is ever added


NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDef(Strict):
    name: str = Field(pattern=NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class ToolChoiceFunction(Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Strict):
    name: str = Field(pattern=NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("`json_schema` is required with type `json_schema` and only allowed with it")
        return self


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
MAX_STOPS = 32  # OpenAI allows 4; lm-eval's tasks send their own `until` list and the end-of-text string


class Sampling(Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-2**63, lt=2**64)  # what torch's generator takes
    n: int = Field(1, ge=1, le=1)
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    """An extension (as in vLLM and Hugging Face): > 1 makes every token already in the prompt or
    the answer less likely; 1 changes nothing."""
    user: Any = None

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias):
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"keys are token ids (as strings); got {key!r}")
        return bias

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def budget(self) -> int | None:
        return self.max_tokens

    def check(self) -> None:
        """Problems across fields (ApiError naming one); a single field's are the model's own."""


TOP_LOGPROBS = 20  # OpenAI's limit for chat
LEGACY_LOGPROBS = 5  # and for completions


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    # refused unless harmless (REFUSED_CHAT), and ignored (IGNORED_CHAT): declared so they parse
    audio: Any = None
    modalities: Any = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    prediction: Any = None

    def check(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: needs `logprobs: true`", param="top_logprobs", code="invalid_value")
        for name in ("tool_choice", "parallel_tool_calls"):
            if getattr(self, name) is not None and not self.tools:
                raise ApiError(400, f"{name}: only allowed when `tools` are given", param=name,
                               code="invalid_value")

    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def report(self) -> int | None:
        """How many likeliest tokens to report beside each token; None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = str | list[str] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(Sampling):
    prompt: Prompt
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompt's log-likelihood only
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=LEGACY_LOGPROBS, strict=True)
    suffix: Any = None
    best_of: Any = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt):
        if not prompt or (isinstance(prompt, list) and any(not p for p in prompt if isinstance(p, (str, list)))):
            raise ValueError("the prompt is empty: give text or token ids")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """Each prompt (OpenAI's form: one string, strings, token ids, or lists of token ids)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "IGNORED_CHAT", "IGNORED_COMPLETION", "LEGACY_LOGPROBS",
           "Message", "REFUSED_CHAT", "REFUSED_COMPLETION", "ResponseFormat", "Sampling", "TOP_LOGPROBS", "Tool",
           "refusal"]
