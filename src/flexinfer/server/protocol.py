"""The OpenAI API's request and response bodies, as pydantic models.

Requests are validated strictly (a string where a number belongs, a float
token id, a bool for an int is a 400, never silently converted). Fields
other servers accept and this one does not implement (logprobs, echo,
penalties, tools, function calling, ...) are declared so that a request using them is told so
(400) rather than served as if they had been honoured; fields nobody
declares are ignored, as the OpenAI and vLLM servers do. The vLLM extras
(top_k, min_tokens, ignore_eos, stop_token_ids, return_token_ids) are
accepted in the body (`extra_body` in the openai client).
"""

from __future__ import annotations

import typing
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def _omit_none(value) -> bool:
    return value is None


def _null_means_default(model: type[BaseModel], name: str) -> bool:
    field = model.model_fields.get(name)
    return field is not None and not field.is_required() and type(None) not in typing.get_args(field.annotation)


# -- requests ------------------------------------------------------------


class _Options(BaseModel):
    """A body of optional fields, validated strictly."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        """OpenAI's optional fields are nullable (`"n": null`, `"stream":
        null`): a client that writes every field sends null for those it
        leaves unset. Where a field's type has no null, null means its
        default; a required field (prompt, messages) must still be given,
        and where null is a value (completions' max_tokens) it stays."""
        if isinstance(data, dict):
            data = {key: value for key, value in data.items() if value is not None or not _null_means_default(cls, key)}
        return data


class StreamOptions(_Options):
    include_usage: bool = False


class SamplingRequest(_Options):
    """What completions and chat completions share."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=128)  # OpenAI's limit: each sample is a sequence in the engine
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras.
    top_k: int | None = None  # 0 or -1: off
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False  # choices carry `token_ids`, the response `prompt_token_ids`
    # Accepted by OpenAI, not implemented here: a request that sets them gets a 400.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI's chat field, vLLM's on completions too (guided decoding).
    response_format: dict | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this server does not implement."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                return name
        if self.logit_bias:
            return "logit_bias"
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format"
        return None


class CompletionRequest(SamplingRequest):
    # Text, token ids, or a list of either (one choice per prompt and sample).
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions; null: up to the context length
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.logprobs is not None:
            return "logprobs"
        if self.suffix:
            return "suffix"
        if self.best_of not in (None, 1):
            return "best_of"
        return super().unsupported()


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    # What a 400 calls it (validation.py): one, several.
    API_NAMES: ClassVar[tuple[str, str]] = ('a text part ({"type": "text", "text": ...})',
                                            'text parts ({"type": "text", "text": ...})')

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    # The roles OpenAI defines; "developer" is its newer name for "system"
    # (serving.py renders it as "system" for a template that does not know it).
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # OpenAI lets only an assistant message that called tools go without
    # content, and this server takes no tools: every message needs it.
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _content_given(cls, value):
        if value is None:
            raise ValueError("content must be a string or a list of text parts, not null (null content is for "
                             "assistant messages with tool_calls, which this server does not support)")
        return value

    def text(self) -> str:
        """The content as one string (text parts joined), as chat templates read it."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    # None: up to the context length. max_completion_tokens is the newer name; it wins.
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    # Without tools, only choices that call none are honoured: "required" or
    # a named function would be answered with text as if they had been.
    tool_choice: str | dict | None = None
    # The older function calling (before tools).
    functions: list[dict] | None = None
    function_call: str | dict | None = None

    def unsupported(self) -> str | None:
        if self.logprobs:
            return "logprobs"
        if self.top_logprobs is not None:
            return "top_logprobs"
        for name in ("tools", "functions"):
            if getattr(self, name):
                return name
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):
                return name
        return super().unsupported()


# -- responses -----------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    # In a stream: null on every chunk but the last, with stream_options.include_usage.
    usage: Usage | None = None
    prompt_token_ids: list[list[int]] | None = Field(default=None, exclude_if=_omit_none)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)


class Delta(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_omit_none)
    content: str | None = Field(default=None, exclude_if=_omit_none)


class ChatStreamChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flexinfer"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
