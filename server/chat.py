"""POST /v1/chat/completions: n choices of one rendered conversation, answered whole or streamed."""
from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.types import TokenLogprobs
from server.errors import APIError
from server.openai_schemas import ChatCompletionRequest
from server.response_bodies import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    Usage,
)
from server.serving import Choice, Delta, Serving, check_logprobs_count, usage
from server.streaming import ChunkStream, stream_response
from server.structured import checked_response_format, response_format_grammar
from server.tool_calls import ToolCallParser, ToolPlan, call_deltas, finish_reason_for, parse_message, plan_tools


async def create_chat_completion(serving: Serving, request: Request, req: ChatCompletionRequest,
                                 release: Callable[[], None], arrival: float) -> Response:
    request_id = serving.new_request_id("chatcmpl", request)
    request_id, ids, choices, tools = await chat_choices(serving, req, arrival, request_id)
    streams = serving.submit(choices)
    fmt = ChatFormat(serving, req, request_id, ids, choices, tools)
    if req.stream:
        return await stream_response(request, serving, choices, streams, fmt, release)
    await serving.run_to_end(request, choices, streams, release)
    return JSONResponse(fmt.response(usage(choices)).body())


async def chat_choices(serving: Serving, req: ChatCompletionRequest, arrival: float,
                       request_id: str) -> tuple[str, list[int], list[Choice], ToolPlan]:
    """The request's choices (engine requests named `<request_id>-<index>`), its prompt and its tool plan."""
    stops = serving.check_common(req)
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    grammar = response_format_grammar(req.response_format)
    if tools.grammar is not None:
        if grammar is not None:
            raise APIError(400, "response_format: cannot be combined with tool_choice 'required' or a named "
                                "function", param="response_format")
        grammar = tools.grammar = await serving.grammars.check(tools.grammar, "tools")
    else:
        grammar = await checked_response_format(serving.grammars, grammar)
    check_logprobs_count(req.top_logprobs, "top_logprobs")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    ids = await serving.render_chat(req.messages, req.add_generation_prompt, req.continue_final_message,
                                    tools.template_tools())
    serving.check_prompt(ids)
    choices = [serving.new_choice(i, request_id, ids,
                                  serving.sampling_params(req, len(ids), max_tokens, logprobs, i, grammar=grammar),
                                  stops, req, arrival) for i in range(req.n)]
    return request_id, ids, choices, tools


class ChatFormat(ChunkStream):
    """chat.completion objects, or chat.completion.chunk ones for a stream."""

    def __init__(self, serving: Serving, req: ChatCompletionRequest, request_id: str, prompt_ids: list[int],
                 choices: list[Choice], tools: ToolPlan) -> None:
        self.serving, self.req, self.prompt_ids, self.choices = serving, req, prompt_ids, choices
        self.tools = tools
        self.tool_parsers = {c.index: ToolCallParser(tools.forced) for c in choices} if tools.parses else {}
        self.head = dict(id=request_id, created=int(time.time()), model=serving.model_name)
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.continuous_usage = self.include_usage and req.stream_options.continuous_usage_stats

    def _logprobs(self, lps: list[TokenLogprobs]) -> ChatLogprobs | None:
        return self.serving.chat_logprobs(lps) if self.req.logprobs else None

    def response(self, usage: Usage) -> ChatCompletionResponse:
        out = []
        for c in self.choices:
            message, finish = AssistantMessage(content=c.text), c.finish_reason
            if self.tools.parses:
                parsed = parse_message(c.text, c.finish_reason, self.tools.forced)
                message, finish = AssistantMessage(content=parsed.content), parsed.finish_reason
                if parsed.tool_calls:
                    message.tool_calls = parsed.tool_calls
            choice = ChatChoice(index=c.index, message=message, logprobs=self._logprobs(c.logprobs),
                                finish_reason=finish, stop_reason=c.stop_reason)
            if self.req.return_token_ids:
                choice.token_ids = c.token_ids
            out.append(choice)
        response = ChatCompletionResponse(**self.head, choices=out, usage=usage)
        if self.req.return_token_ids:
            response.prompt_token_ids = self.prompt_ids
        return response

    def _chunk(self, choice: ChatChunkChoice, first: bool = False) -> dict:
        chunk = ChatCompletionChunk(**self.head, choices=[choice])
        if self.include_usage:
            chunk.usage = None
        if first and self.req.return_token_ids:
            chunk.prompt_token_ids = self.prompt_ids
        return chunk.body()

    def preamble(self) -> list[dict]:
        return [self._chunk(ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content=""),
                                            logprobs=None, finish_reason=None), first=True) for c in self.choices]

    def on_delta(self, c: Choice, delta: Delta) -> dict | None:
        wants_ids = self.req.logprobs or self.req.return_token_ids
        chat_delta, finish = self._tool_delta(c, delta) if self.tools.parses else (
            ChatDelta(content=delta.text) if delta.text else ChatDelta(), delta.finish_reason)
        if not (chat_delta.content or chat_delta.tool_calls or finish or (delta.token_ids and wants_ids)):
            return None
        choice = ChatChunkChoice(index=c.index, delta=chat_delta, logprobs=self._logprobs(delta.logprobs),
                                 finish_reason=finish)
        if delta.finish_reason is not None:
            choice.stop_reason = c.stop_reason
        if self.req.return_token_ids:
            choice.token_ids = delta.token_ids
        return self._chunk(choice)

    def _tool_delta(self, c: Choice, delta: Delta) -> tuple[ChatDelta, str | None]:
        """Content outside <tool_call> blocks as it comes; each call's arguments as they are written."""
        parser = self.tool_parsers[c.index]
        content, events = parser.push(delta.text)
        if delta.finish_reason is not None:
            rest, more = parser.finish()
            content, events = content + rest, events + more
        out = ChatDelta(content=content) if content else ChatDelta()
        deltas = call_deltas(events)
        if deltas:
            out.tool_calls = deltas
        return out, finish_reason_for(parser.calls, delta.finish_reason)

    def usage_chunk(self, usage: Usage) -> dict:
        return ChatCompletionChunk(**self.head, choices=[], usage=usage).body()
