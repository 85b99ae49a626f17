"""The request bodies the server accepts, as OpenAI's clients send them, and its error type."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class OtherPart(BaseModel):
    """Any part that is not text (image_url, input_audio, file, ...): named in a clear 400."""

    model_config = ConfigDict(extra="allow")
    type: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart | OtherPart]

    @field_validator("content")
    @classmethod
    def _text_only(cls, content):
        if isinstance(content, list):
            other = next((p.type for p in content if not isinstance(p, TextPart)), None)
            if other == "text":
                raise ValueError("a part of type `text` needs a string `text`")
            if other is not None:
                raise ValueError(f"content parts of type `{other}` are not supported: this server serves a "
                                 "text-only model; send text parts (or a string) only")
        return content

    def as_template(self) -> dict:
        """The message as a chat template takes it: one string (text parts joined, as OpenAI does)."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=1)
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    """An extension (as in vLLM and Hugging Face): > 1 makes every token already in the prompt or
    the answer less likely; 1 changes nothing."""

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(Sampling):
    prompt: str


__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "Message", "Sampling"]
