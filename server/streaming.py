"""Server-sent events for the generation routes: all choices of a request interleaved as they
come, `data: [DONE]` at the end, and the request's resources freed however the stream ends."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from engine.types import FinishReason
from server.errors import error_body
from server.response_bodies import Usage
from server.serving import Choice, Delta, Serving, choice_usage, sse, usage


class StreamFormat(Protocol):
    """How one route writes its chunks (completions, chat and responses differ)."""

    def preamble(self) -> list[dict]: ...
    def on_delta(self, choice: Choice, delta: Delta) -> dict | list[dict] | None: ...
    def usage_chunk(self, usage: Usage) -> dict: ...
    def encode(self, event: dict) -> str: ...

    include_usage: bool
    continuous_usage: bool  # stream_options.continuous_usage_stats (with include_usage)
    end: str  # what the stream ends with after its last event


class ChunkStream:
    """The framing of the chat and completions streams: `data:` lines, then `data: [DONE]`."""

    end = "data: [DONE]\n\n"

    @staticmethod
    def encode(event: dict) -> str:
        return sse(event)


class ContinuousUsage:
    """stream_options.continuous_usage_stats, as vLLM does it: every chunk carries the usage of its
    choice so far, completion_tokens counting every token streamed up to and with that chunk (a
    speculative step's several tokens included)."""

    def __init__(self, choices: list[Choice], enabled: bool) -> None:
        self.enabled = enabled
        self.by_index = {c.index: c for c in choices}
        self.streamed = dict.fromkeys(self.by_index, 0)

    def count(self, choice: Choice, delta: Delta) -> None:
        self.streamed[choice.index] += len(delta.token_ids)

    def stamp(self, chunk: dict) -> dict:
        if self.enabled and chunk.get("choices"):
            index = chunk["choices"][0]["index"]
            chunk["usage"] = choice_usage(self.by_index[index], self.streamed[index]).body()
        return chunk


class ClosingStreamingResponse(StreamingResponse):
    """Runs `on_close` however the response ends (finished, client gone, send failed), even if
    the body iterator never started — the one place that reliably frees a stream's resources."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def stream_response(request: Request, serving: Serving, choices: list[Choice], streams, fmt: StreamFormat,
                          release: Callable[[], None]) -> StreamingResponse:
    """The response starts once every choice has its first event: a request the engine client
    refuses (bad input, no instance available) still gets a real 400/503, not a 200 whose
    stream holds an error. Failures after that arrive as an error event in the stream."""
    events: asyncio.Queue = asyncio.Queue()
    tasks = serving.start(choices, streams, events)
    await serving.wait_started(request, choices, tasks)

    def close() -> None:
        serving.cancel(tasks)  # aborts whatever is still generating (client gone)
        release()

    async def body() -> AsyncIterator[str]:
        counter = ContinuousUsage(choices, fmt.continuous_usage)
        try:
            for chunk in fmt.preamble():
                yield fmt.encode(counter.stamp(chunk))
            async for line in _events(events, len(choices), fmt, counter):
                yield line
            if fmt.include_usage:
                yield fmt.encode(fmt.usage_chunk(usage(choices)))
            if fmt.end:
                yield fmt.end
        finally:
            close()  # synchronous: this may run inside a cancelled scope

    return ClosingStreamingResponse(body(), on_close=close, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(events: asyncio.Queue, num_choices: int, fmt: StreamFormat,
                  counter: ContinuousUsage) -> AsyncIterator[str]:
    remaining = num_choices
    while remaining:
        choice, delta = await events.get()
        if delta is None:  # that choice is over
            remaining -= 1
            continue
        if choice.bad_input is not None:
            yield fmt.encode(error_body(choice.bad_input, "invalid_request_error", None, 400))
        elif delta.finish_reason == FinishReason.ERROR:
            yield fmt.encode(error_body(f"generation failed: {choice.error}", "server_error", None, 500))
        else:
            counter.count(choice, delta)
            out = fmt.on_delta(choice, delta)
            chunks = [] if out is None else out if isinstance(out, list) else [out]
            for i, chunk in enumerate(chunks):
                last = i == len(chunks) - 1
                yield fmt.encode(counter.stamp(_with_handoff(choice, delta, chunk) if last else chunk))


def _with_handoff(choice: Choice, delta: Delta, chunk: dict) -> dict:
    """The choice's finish chunk carries its PD hand-off time when the client asked for it and the
    request went through one: the value the front end put in pdserve:pd_handoff_seconds, so a load
    tool can report per-request hand-off percentiles that match the histogram."""
    if choice.report_handoff and delta.finish_reason is not None and choice.handoff_s is not None:
        chunk["pd_handoff_ms"] = choice.handoff_s * 1000.0
    return chunk

