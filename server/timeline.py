"""The last requests as the front end saw them, for the /status page's P -> transfer -> D timeline.

The router client (server/pd_client.py) calls three hooks: `dispatched` when it sends a request to
its P and D (again on a retry or a resume), `output` for every engine output it delivers, and
`finished` when the client's stream ends. What the front end cannot see directly it infers from
what it can: t0 is P's first output, and D's first output means D's KV transfer has landed.
A bounded ring: the page shows recent requests, never a history that grows with uptime.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_CAPACITY = 64


@dataclass
class RequestTrace:
    """Wall-clock times (seconds since the epoch) of one request's stages; None: not reached yet."""

    req_id: str
    prompt_len: int
    arrival: float
    prefill: str = ""                   # the instance that prefills (colocated: the only one)
    decode: str = ""                    # the instance that decodes (colocated: the same)
    attempts: int = 0                   # dispatches: 1, or more after a retry or a resume
    dispatched: float | None = None     # the latest dispatch
    first_token: float | None = None    # t0 reached the front end (P's output; colocated: the first)
    decode_first: float | None = None   # D's first output of the latest attempt: its KV has landed
    finished: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_output_tokens: int = 0


class Timeline:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._traces: OrderedDict[str, RequestTrace] = OrderedDict()

    def dispatched(self, req_id: str, prompt_len: int, prefill: str, decode: str) -> None:
        now = time.time()
        trace = self._traces.get(req_id)
        if trace is None or trace.finished is not None:  # a new request (or an id reused after its end)
            trace = RequestTrace(req_id, prompt_len, arrival=now)
            self._traces[req_id] = trace
            self._traces.move_to_end(req_id)
            while len(self._traces) > self.capacity:
                self._traces.popitem(last=False)
        trace.attempts += 1
        trace.prefill, trace.decode, trace.dispatched = prefill, decode, now
        trace.decode_first = None  # a retry or resume hands off again, to this attempt's D

    def output(self, req_id: str, instance: str, num_tokens: int) -> None:
        trace = self._traces.get(req_id)
        if trace is None or trace.finished is not None:
            return
        now = time.time()
        if num_tokens and trace.first_token is None:
            trace.first_token = now
        if instance == trace.decode != trace.prefill and trace.decode_first is None:
            trace.decode_first = now
        trace.num_output_tokens += num_tokens

    def finished(self, req_id: str, reason: str, error: str | None = None) -> None:
        """The first call wins: the end of the stream, then (idempotently) the client forgetting it."""
        trace = self._traces.get(req_id)
        if trace is not None and trace.finished is None:
            trace.finished, trace.finish_reason, trace.error = time.time(), str(reason), error

    def recent(self, limit: int | None = None) -> list[RequestTrace]:
        """Newest first."""
        traces = list(reversed(self._traces.values()))
        return traces if limit is None else traces[:limit]
