"""POST /v1/responses (OpenAI's Responses API, stateless): the request runs through the chat
pipeline (server/chat.py: template, tools, grammars, sampling) and its one choice is answered as
a `response` object, or streamed as typed events (`response.created` ... `response.completed`,
each with its `sequence_number`)."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.types import FinishReason
from server.chat import chat_choices
from server.openai_schemas import ChatCompletionRequest, ResponsesRequest
from server.response_bodies import Usage
from server.responses_input import chat_request, responses_params
from server.responses_output import OutputBuilder
from server.serving import Choice, Delta, Serving, usage
from server.streaming import stream_response
from server.tool_calls import ToolCallParser, ToolPlan


async def create_response(serving: Serving, request: Request, req: ResponsesRequest,
                          release: Callable[[], None], arrival: float) -> Response:
    chat = chat_request(req)
    with responses_params():
        request_id = serving.new_request_id("resp", request)
        request_id, _, choices, tools = await chat_choices(serving, chat, arrival, request_id)
    streams = serving.submit(choices)
    fmt = ResponsesFormat(serving, req, chat, request_id, choices[0], tools)
    if req.stream:
        return await stream_response(request, serving, choices, streams, fmt, release)
    await serving.run_to_end(request, choices, streams, release)
    fmt.builder.push(choices[0].text)
    fmt.builder.finish(choices[0].finish_reason != FinishReason.LENGTH)
    return JSONResponse(fmt.response(usage(choices)))


def response_usage(u: Usage) -> dict[str, Any]:
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details is not None else 0
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens}


class ResponsesFormat:
    """The `response` object and the stream's events, for the one choice of a Responses request."""

    include_usage = True  # the stream's last event (response.completed) carries the usage
    continuous_usage = False
    end = ""  # no `data: [DONE]`: the last event says the stream is over

    def __init__(self, serving: Serving, req: ResponsesRequest, chat: ChatCompletionRequest, request_id: str,
                 choice: Choice, tools: ToolPlan) -> None:
        self.req, self.chat, self.choice = req, chat, choice
        self.builder = OutputBuilder(ToolCallParser(tools.forced) if tools.parses else None)
        self.head = {"id": request_id, "object": "response", "created_at": int(time.time()),
                     "model": serving.model_name}
        self.sequence = 0

    def response(self, u: Usage | None, status: str | None = None) -> dict[str, Any]:
        """The response object; `status` None: what the choice's end makes it."""
        finish = self.choice.finish_reason
        if status is None:
            status = {None: "in_progress", FinishReason.LENGTH: "incomplete", FinishReason.ERROR: "failed"}.get(
                finish, "completed")
        req = self.req
        text_format = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format \
            else {"type": "text"}
        return {
            **self.head, "status": status,
            "error": {"code": "server_error", "message": self.choice.error or "generation failed"}
            if status == "failed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "output": list(self.builder.items) if status != "in_progress" else [],
            "parallel_tool_calls": self.chat.parallel_tool_calls, "previous_response_id": None, "reasoning": None,
            "store": False, "background": False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "text": {"format": text_format}, "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "truncation": "disabled", "metadata": req.metadata or {}, "user": req.user,
            "usage": response_usage(u) if u is not None else None,
        }

    def preamble(self) -> list[dict]:
        snapshot = self.response(None, "in_progress")
        return [{"type": "response.created", "response": snapshot},
                {"type": "response.in_progress", "response": snapshot}]

    def on_delta(self, choice: Choice, delta: Delta) -> list[dict]:
        events = self.builder.push(delta.text)
        if delta.finish_reason is not None:
            events += self.builder.finish(delta.finish_reason != FinishReason.LENGTH)
        return events

    def usage_chunk(self, u: Usage) -> dict:
        final = self.response(u)
        kind = {"incomplete": "response.incomplete", "failed": "response.failed"}.get(final["status"],
                                                                                      "response.completed")
        return {"type": kind, "response": final}

    def encode(self, event: dict) -> str:
        """`event:` and `data:` lines, as OpenAI sends them; sequence numbers count every event."""
        event["sequence_number"] = self.sequence
        self.sequence += 1
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        return f"event: {event.get('type', 'error')}\ndata: {data}\n\n"
