"""What the HTTP front end needs from the engines, whatever runs them (in-process, colocated
process, or a prefill/decode pair over ZMQ)."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from engine.types import EngineRole, FinishReason, SamplingParams, TokenLogprobs


@dataclass
class GenerationChunk:
    """New tokens of one request. The last chunk of a request has `finish_reason` set
    ("stop", "length", "abort", or "error" with `error` holding a message)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    # Seconds the request waited in the engine before it was first scheduled; set on one chunk
    # (the first) by clients that know it, feeds pdserve:request_queue_time_seconds.
    queue_time: float | None = None
    # On the chunk with the first token: the prompt's logprobs when asked for (tokens 1..; token 0
    # has none) and the prompt tokens the prefix cache served.
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int | None = None
    # PD: seconds from P's first token to D's first tokens reaching the front end; on one chunk.
    handoff_s: float | None = None


@dataclass
class InstanceInfo:
    """One engine instance as /metrics and /health see it."""

    name: str           # e.g. "prefill-0", "decode-1", "colocated-0"
    role: EngineRole
    ready: bool
    kv_blocks_free: int
    kv_blocks_total: int
    num_running: int
    num_waiting: int
    counters: dict[str, float] = field(default_factory=dict)  # monotonically increasing engine counters
    # Counters with one value per draft position (exported with a `position` label).
    per_position: dict[str, list[float]] = field(default_factory=dict)
    state: str = "ready"          # starting | ready | stalled | dead | left (server/engine_router.py)
    step_running_s: float = 0.0   # how long its step in progress has been running


class EngineClient(Protocol):
    """Implemented by the PD router client (server/pd_client.py) and, in tests, an in-process one
    (tests/local_client.py)."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]

    async def start(self) -> None: ...
    async def stop(self) -> None: ...

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        """Submit and stream the request. Raises ValueError (bad input) before yielding anything.
        If the consumer stops iterating early (client disconnect), the request must be aborted."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def is_ready(self) -> bool: ...

    def instances(self) -> list[InstanceInfo]: ...


class EngineUnavailableError(RuntimeError):
    """No engine instance can take the request right now (the front end answers 503)."""
