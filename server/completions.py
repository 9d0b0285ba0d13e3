"""POST /v1/completions: a request's prompts x n choices, answered whole or streamed."""
from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.types import TokenLogprobs
from server.errors import APIError
from server.openai_schemas import CompletionRequest
from server.response_bodies import CompletionChoice, CompletionLogprobs, CompletionResponse, Usage
from server.serving import MAX_CHOICES, Choice, Delta, Serving, check_logprobs_count, usage
from server.streaming import ChunkStream, stream_response
from server.structured import checked_response_format, response_format_grammar


async def create_completion(serving: Serving, request: Request, req: CompletionRequest,
                            release: Callable[[], None], arrival: float) -> Response:
    request_id, choices = await _choices(serving, req, arrival, serving.new_request_id("cmpl", request))
    streams = serving.submit(choices)
    fmt = CompletionFormat(serving, req, request_id, choices)
    if req.stream:
        return await stream_response(request, serving, choices, streams, fmt, release)
    await serving.run_to_end(request, choices, streams, release)
    out = [fmt.choice(c, c.prompt_text + c.text, c.token_ids, c.logprobs, c.finish_reason, True) for c in choices]
    return JSONResponse(fmt.response(out, usage(choices)).body())


async def _choices(serving: Serving, req: CompletionRequest, arrival: float,
                   request_id: str) -> tuple[str, list[Choice]]:
    stops = serving.check_common(req)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    check_logprobs_count(req.logprobs, "logprobs")
    grammar = await checked_response_format(serving.grammars, response_format_grammar(req.response_format))
    prompts = await _prompts(serving, req)
    choices: list[Choice] = []
    for p_idx, ids in enumerate(prompts):
        for j in range(req.n):
            idx = p_idx * req.n + j
            # echo + logprobs: the prompt's logprobs too, with as many alternatives (OpenAI's legacy API).
            params = serving.sampling_params(req, len(ids), req.max_tokens, req.logprobs, idx,
                                             prompt_logprobs=req.logprobs if req.echo else None, grammar=grammar)
            c = serving.new_choice(idx, request_id, ids, params, stops, req, arrival)
            if req.echo:
                c.prompt_text = serving.decode(ids)
                c.text_offset = len(c.prompt_text)
            choices.append(c)
    return request_id, choices


async def _prompts(serving: Serving, req: CompletionRequest) -> list[list[int]]:
    """The request's prompts as token ids: a string, a list of strings, ids, or a list of id lists."""
    p = req.prompt
    if isinstance(p, str):
        raw: list = [p]
    elif not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    elif isinstance(p[0], int):
        raw = [p]
    else:
        raw = list(p)
    if len(raw) * req.n > MAX_CHOICES:  # before tokenizing what could be a million prompts
        raise APIError(400, f"n: prompts x n must be at most {MAX_CHOICES}", param="n")
    out = []
    for i, item in enumerate(raw):
        param = "prompt" if len(raw) == 1 else f"prompt[{i}]"
        ids = await serving.encode(item, req.add_special_tokens, param) if isinstance(item, str) else list(item)
        serving.check_prompt(ids, param)
        out.append(ids)
    return out


def _concat(a: CompletionLogprobs | None, b: CompletionLogprobs | None) -> CompletionLogprobs | None:
    if a is None or b is None:
        return a or b
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


class CompletionFormat(ChunkStream):
    """text_completion objects: the whole response, or one stream chunk at a time."""

    def __init__(self, serving: Serving, req: CompletionRequest, request_id: str, choices: list[Choice]) -> None:
        self.serving, self.req, self.choices = serving, req, choices
        self.head = dict(id=request_id, created=int(time.time()), model=serving.model_name)
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.continuous_usage = self.include_usage and req.stream_options.continuous_usage_stats

    def choice(self, c: Choice, text: str, ids: list[int], lps: list[TokenLogprobs] | None, finish: str | None,
               first: bool) -> CompletionChoice:
        """`lps` None: no logprobs of generated tokens (the echo preamble of a stream). `first`: the
        choice's first object, which with echo holds the prompt (and its logprobs)."""
        logprobs = None
        if self.req.logprobs is not None and lps is not None:
            logprobs = self.serving.completion_logprobs(c, lps)
        if self.req.logprobs is not None and first and self.req.echo:
            logprobs = _concat(self.serving.echo_logprobs(c), logprobs)
        out = CompletionChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=finish)
        if finish is not None:
            out.stop_reason = c.stop_reason
        if self.req.return_token_ids:
            out.token_ids = ids
            if first:
                out.prompt_token_ids = c.prompt_ids
        return out

    def response(self, choices: list[CompletionChoice], usage: Usage) -> CompletionResponse:
        return CompletionResponse(**self.head, choices=choices, usage=usage)

    def _chunk(self, choice: CompletionChoice) -> dict:
        chunk = CompletionResponse(**self.head, choices=[choice])
        if self.include_usage:
            chunk.usage = None
        return chunk.body()

    def preamble(self) -> list[dict]:
        if not (self.req.echo or self.req.return_token_ids):
            return []
        return [self._chunk(self.choice(c, c.prompt_text, [], None, None, True)) for c in self.choices]

    def on_delta(self, c: Choice, delta: Delta) -> dict | None:
        wants_ids = self.req.logprobs is not None or self.req.return_token_ids
        if not (delta.text or delta.finish_reason or (delta.token_ids and wants_ids)):
            return None
        return self._chunk(self.choice(c, delta.text, delta.token_ids, delta.logprobs, delta.finish_reason, False))

    def usage_chunk(self, usage: Usage) -> dict:
        return self.response([], usage).body()
