"""A Responses API request as the chat pipeline's input: `input` items and `instructions` become
chat messages, flat function tools become chat tools, `text.format` becomes `response_format`.

The server keeps no responses, so what needs a stored one is refused with a 400 that says so:
`previous_response_id`, `conversation`, `prompt` (a stored template), `store: true`,
`background: true`. An omitted `store`
(OpenAI's default is to store) is served and not stored, as vLLM does without its store.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from server.errors import APIError, parse_model
from server.openai_schemas import ChatCompletionRequest, ResponsesRequest

_STATELESS = "this server is stateless and keeps no responses"
# Chat parameter names as the Responses API names them, for errors raised by the chat pipeline.
_PARAMS = (("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
           ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"), ("messages", "input"))
_TEXT_PART_TYPES = ("input_text", "output_text", "text")


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    _refuse_stateful(req)
    body: dict[str, Any] = dict(
        model=req.model, messages=_messages(req), max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, tools=_tools(req.tools),
        tool_choice=_tool_choice(req.tool_choice), response_format=_response_format(req), stream=req.stream,
        seed=req.seed, top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty)
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    with responses_params():
        return parse_model(ChatCompletionRequest, body)


@contextmanager
def responses_params():
    """Errors of the chat pipeline, naming the Responses API's parameters."""
    try:
        yield
    except APIError as exc:
        for chat, ours in _PARAMS:
            if exc.param is not None and exc.param.startswith(chat):
                exc.param = ours + exc.param[len(chat):]
                exc.message = exc.message.replace(chat, ours, 1)
                break
        raise


def _refuse_stateful(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise APIError(400, f"previous_response_id: {_STATELESS}; send the whole conversation in `input`",
                       param="previous_response_id")
    if req.conversation is not None:
        raise APIError(400, f"conversation: {_STATELESS}; send the whole conversation in `input`",
                       param="conversation")
    if req.prompt is not None:
        raise APIError(400, f"prompt: {_STATELESS} and no prompt templates; send the text in `input`",
                       param="prompt")
    if req.store:
        raise APIError(400, f"store: {_STATELESS}; send store=false or leave it out", param="store")
    if req.background:
        raise APIError(400, f"background: {_STATELESS}, so it cannot run a response in the background",
                       param="background")
    if req.top_logprobs:
        raise APIError(400, "top_logprobs: logprobs are not supported on /v1/responses", param="top_logprobs")


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return out + [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            _add_call(out, item, i)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                        "content": _text(item.get("output"), f"input[{i}].output")})
        else:
            raise APIError(400, f"input[{i}].type: {kind!r} is not supported (message, function_call and "
                                "function_call_output are)", param=f"input[{i}].type")
    return out


def _add_call(out: list[dict[str, Any]], item: dict[str, Any], i: int) -> None:
    """A function_call joins the assistant turn before it (its text, or calls made with it)."""
    call = {"id": _string(item, "call_id", i), "type": "function",
            "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"input[{i}].{key}: must be a string", param=f"input[{i}].{key}")
    return value


def _text(content: Any, param: str) -> str:
    """A message's content (a string or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param}: must be a string or a list of text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in _TEXT_PART_TYPES and isinstance(part.get("text"), str)):
            raise APIError(400, f"{param}[{j}]: only text parts ({', '.join(_TEXT_PART_TYPES)}) are supported",
                           param=f"{param}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools as chat tools (server/tool_calls.py checks them further)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not (isinstance(tool, dict) and tool.get("type") == "function"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(400, f"tools[{i}].type: only function tools are supported, got {kind!r}",
                           param=f"tools[{i}].type")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                          "strict") if k in tool}})
    return out


def _tool_choice(choice: Any) -> Any:
    """{"type": "function", "name": ...} is the Responses form of chat's named function."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _forces_calls(choice: Any) -> bool:
    return choice == "required" or (isinstance(choice, dict) and choice.get("type") == "function")


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    """`text.format` applies to the output's text. A forced call has none, so it is not enforced
    then (chat refuses the pair; agent SDKs send both when an agent with an output type must call a tool)."""
    fmt = req.text.format if req.text is not None else None
    if _forces_calls(req.tool_choice):
        return None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else {"type": fmt.type}
    if fmt.schema_ is None:
        raise APIError(400, "text.format.schema: is required for type 'json_schema'", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                   "strict": fmt.strict, "description": fmt.description}}
