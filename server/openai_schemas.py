"""Request bodies of the OpenAI-compatible API (pydantic), plus vLLM's common extensions.

Policy on fields, made explicit:
- Unknown fields are ignored (`extra="ignore"`): OpenAI SDKs and tools send fields this server
  has never heard of, and refusing them would break those clients.
- Known OpenAI fields that would change the answer but are not implemented (`suffix`,
  non-empty `logit_bias`, `best_of` != n, ...) are refused
  with a 400 naming the field rather than silently ignored.
- NaN and infinities are refused everywhere (`allow_inf_nan=False`); token ids must be JSON
  integers (no floats, strings or booleans).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16

TokenId = StrictInt
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX - MAX_N)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: Seed | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    request_id: str | None = Field(None, max_length=256)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    name: StrictStr
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow BaseModel.schema
    strict: bool | None = None


class ResponseFormat(_Body):
    type: StrictStr  # text | json_object | json_schema (server/structured.py)
    json_schema: JsonSchemaFormat | None = None


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]]
    response_format: ResponseFormat | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None                 # a tool turn: the call it answers


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None  # checked by server/tool_calls.py (errors name tools[i])
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: StrictStr
    add_special_tokens: bool = True


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]
