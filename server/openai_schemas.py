"""Request bodies of the OpenAI-compatible API (pydantic), plus vLLM's common extensions.

Policy on fields, made explicit:
- Unknown fields are ignored (`extra="ignore"`): OpenAI SDKs and tools send fields this server
  has never heard of, and refusing them would break those clients.
- Known OpenAI fields that would change the answer but are not implemented (`suffix`,
  non-empty `logit_bias`, `best_of` != n, ...) are refused
  with a 400 naming the field rather than silently ignored.
- NaN and infinities are refused everywhere (`allow_inf_nan=False`); token ids must be JSON
  integers (no floats, strings or booleans).
- Every integer field is a 64-bit integer (a 400 naming the field otherwise: the engine message is
  msgpack, which has no bigger ones); the sampling bounds proper (temperature, top_k, penalties,
  ...) are SamplingParams' (engine/types.py), which the engine checks again on its side.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from engine.types import INT64_MAX, INT64_MIN, MAX_STOP_TOKEN_IDS

MAX_N = 64
MAX_STOP_STRINGS = 16
MAX_MESSAGES = 4096       # chat turns in one request
MAX_TOOLS = 256           # tool definitions in one request
MAX_TOKENIZE_CHARS = 1_000_000  # /tokenize text (a 4 MiB body could hold 4M characters)
MAX_DETOKENIZE_IDS = 131_072    # /detokenize token ids

TokenId = StrictInt
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX - MAX_N)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    # pdserve's own: the finish chunk of each choice that went through a PD hand-off carries
    # `pd_handoff_ms` (server/streaming.py). Off unless asked, so strict clients never see it.
    include_pd_handoff: bool = False


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: Seed | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: Int64 = 0
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
    logprobs: Int64 | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


# The roles a chat template knows; anything else (say "system<|im_end|>...") is refused.
ChatRole = Literal["system", "user", "assistant", "tool", "developer"]


class ChatMessage(_Body):
    role: ChatRole
    content: StrictStr | list[dict[str, Any]] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)  # an assistant turn that called tools
    tool_call_id: str | None = None                 # a tool turn: the call it answers


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = Field(None, max_length=MAX_TOOLS)  # checked by server/tool_calls.py (tools[i])
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: StrictStr = Field(..., max_length=MAX_TOKENIZE_CHARS)
    add_special_tokens: bool = True


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId] = Field(..., max_length=MAX_DETOKENIZE_IDS)


class TextFormat(_Body):
    """The Responses API's `text.format`: `response_format` flattened (name and schema inline)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    type: StrictStr  # text | json_object | json_schema
    name: StrictStr | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    """POST /v1/responses, stateless (server/responses_input.py refuses what needs stored state)."""

    model: str | None = None
    input: StrictStr | list[dict[str, Any]] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    instructions: StrictStr | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None  # a stored prompt template, by id
    background: bool | None = None
    top_logprobs: Int64 | None = None
    metadata: dict[str, StrictStr] | None = None
    user: str | None = None
    # vLLM extensions, as on chat
    seed: Seed | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
