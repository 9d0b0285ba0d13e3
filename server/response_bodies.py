"""Response bodies of the OpenAI-compatible API (pydantic), the counterpart of openai_schemas.

A field whose default is None is one OpenAI sends only in some cases (`stop_reason` once a
choice has finished, `token_ids` with vLLM's `return_token_ids`, `usage: null` in stream chunks
when usage was asked for): it is sent only when it was set, even to None. Fields that are always
sent, null or not, have no default.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, model_serializer


class _Response(BaseModel):
    @model_serializer(mode="wrap")
    def _drop_unset_optionals(self, handler) -> dict[str, Any]:
        data = handler(self)
        for name, field in type(self).model_fields.items():
            if field.default is None and name not in self.model_fields_set:
                data.pop(name, None)
        return data

    def body(self) -> dict[str, Any]:
        """The JSON object to send."""
        return self.model_dump()


class PromptTokensDetails(_Response):
    cached_tokens: int


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # in a request's total usage, not per chunk


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float | None]         # None for the first prompt token (echo)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[TokenLogprob]


class _Generation(_Response):
    """The head of every generation response: request id, object type, creation time, model."""

    id: str
    object: str
    created: int
    model: str


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(_Generation):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(_Response):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the answer is only tool calls
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_Generation):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Generation):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int  # when the server loaded the model
    owned_by: str = "pdserve"
    root: str
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(_Response):
    prompt: str


class HealthResponse(_Response):
    status: str = "ok"
