"""Limits that fair clients never hit (issue 45, build 4): the bounds themselves, in-flight caps
per client address and per API key below the global one, and the response size checked up front.

The global cap lives in `Serving.acquire`; the caps here are taken first, so one client (or one
key) can hold at most its share of the server's slots and a second one is never locked out.
HTTP/1.1 carries one request at a time on a connection, so "per connection" is per peer address:
a client holding many slots does it over many connections from one address.

What uvicorn (h11) already bounds is left to it: request heads (`h11_max_incomplete_event_size`,
16 KiB), idle keep-alive connections (`timeout_keep_alive`). It has no body read timeout, and h11
takes Content-Length with Transfer-Encoding (the latter wins): both are handled in
`server.errors.read_body`.
"""
from __future__ import annotations

import logging
import resource
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import flag
from server.errors import APIError
from server.openai_schemas import ChatCompletionRequest, CompletionRequest, ResponsesRequest

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 512
OPEN_FILES_TARGET = 65536  # as vLLM's API server raises it


@dataclass(frozen=True)
class HTTPLimits:
    """Each bound's default is far above what one fair client needs (see each field's note). Each
    field is a flag of the front end's commands (server/flags.py)."""

    # The whole body must arrive within this: a 4 MiB body (the size limit) at 1 Mbit/s takes
    # about half of it. A slow or stalled sender gets 408 and its connection is closed.
    body_read_timeout_s: float = field(default=60.0, metadata=flag(
        "a request body must arrive whole within this (408 and the connection closed otherwise); no serving slot "
        "is taken before it has"))
    # Three quarters of the global cap each: one client or one key can never take the whole server,
    # a quarter always stays for the others, and a benchmark from one host still runs hundreds of
    # requests at once. Behind a reverse proxy every request comes from the proxy's address: set the
    # per-client cap to 0 (off) there.
    max_in_flight_per_client: int = field(default=DEFAULT_MAX_QUEUE * 3 // 4, metadata=flag(
        "requests in flight from one client address (429 beyond; 0: off, e.g. behind a reverse proxy, where every "
        "request has its address)"))
    # Applies only with more than one API key (one shared key identifies the deployment, not a user).
    max_in_flight_per_key: int = field(default=DEFAULT_MAX_QUEUE * 3 // 4, metadata=flag(
        "requests in flight per API key when --api-key lists several keys (429 beyond; 0: off)"))
    # choices x max_tokens x (1 + logprobs): one entry is one token or one top-logprob alternative,
    # a few tens of bytes of JSON. 2^19 admits 128 choices of 4096 tokens each, or one 4096-token
    # choice with 20 alternatives per token, and refuses the 256 choices of 500 tokens with
    # 20 alternatives each.
    max_response_entries: int = field(default=2**19, metadata=flag(
        "refuse (400) a request whose response could hold more than this many choices x max_tokens x (1 + logprobs)"))
    # Entries (as above) a stream may produce while its writer waits on the client's socket (the
    # socket's own buffers are full): a client that reads at all never gets near this.
    max_stream_backlog: int = field(default=2**16, metadata=flag(
        "abort a stream (freeing its KV) once this many tokens x (1 + logprobs) were generated while its client "
        "read nothing"))


class InFlightCaps:
    """Requests in flight per client address and per API key; `acquire` refuses with 429."""

    def __init__(self, limits: HTTPLimits, on_reject: Callable[[], None]) -> None:
        self.limits = limits
        self.on_reject = on_reject
        self.by_client: Counter[str] = Counter()
        self.by_key: Counter[str] = Counter()

    def acquire(self, client: str | None, key: str | None) -> Callable[[], None]:
        """Take a slot under both caps (a cap of 0 is off); returns the idempotent release."""
        taken: list[tuple[Counter[str], str]] = []
        for counts, who, cap, what in ((self.by_client, client, self.limits.max_in_flight_per_client, "client address"),
                                       (self.by_key, key, self.limits.max_in_flight_per_key, "API key")):
            if who is None or cap <= 0:
                continue
            if counts[who] >= cap:
                _release(taken)
                self.on_reject()
                raise APIError(429, f"too many requests in flight for this {what} (at most {cap}); retry later",
                               type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
            counts[who] += 1
            taken.append((counts, who))
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                _release(taken)
        return release


def _release(taken: list[tuple[Counter[str], str]]) -> None:
    for counts, who in taken:
        counts[who] -= 1
        if counts[who] <= 0:
            del counts[who]


def check_response_size(req: CompletionRequest | ChatCompletionRequest | ResponsesRequest, max_model_len: int,
                        limit: int) -> None:
    """400 when the largest response the request could produce is over `limit` entries, before
    any work is done for it. Without max_tokens a choice may run to the context length; with echo
    its prompt comes back too, and prompt + generated tokens never exceed the context length.
    Other checks on the fields involved come later: this one only reads them."""
    param, max_tokens, alternatives, choices = _response_shape(req)
    named = param if max_tokens is not None or isinstance(req, ResponsesRequest) else "n"
    # A max_tokens beyond the context is refused later with its own error (context_length_exceeded).
    tokens = max_model_len if max_tokens is None or getattr(req, "echo", False) else min(max_tokens, max_model_len)
    entries = choices * tokens * (1 + max(alternatives, 0))
    if entries > limit:
        raise APIError(400, f"{named}: the response could hold {entries} entries (choices {choices} x tokens "
                            f"{tokens} x (1 + logprobs {alternatives})), over the limit of {limit}; lower n, "
                            f"{param} or the number of logprobs", param=named)


def _response_shape(req: CompletionRequest | ChatCompletionRequest | ResponsesRequest
                    ) -> tuple[str, int | None, int, int]:
    """(the max-tokens field's name, its value, logprob alternatives per token, choices)."""
    if isinstance(req, ResponsesRequest):
        return "max_output_tokens", req.max_output_tokens, req.top_logprobs or 0, 1
    if isinstance(req, ChatCompletionRequest):
        if req.max_completion_tokens is not None:
            param, max_tokens = "max_completion_tokens", req.max_completion_tokens
        else:
            param, max_tokens = "max_tokens", req.max_tokens
        return param, max_tokens, (req.top_logprobs or 0) if req.logprobs else 0, req.n
    single = isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int))
    return "max_tokens", req.max_tokens, req.logprobs or 0, req.n * (1 if single else max(len(req.prompt), 1))


def raise_open_files_limit(target: int = OPEN_FILES_TARGET) -> int:
    """Raise this process's soft limit on open files towards `target` (never above the hard limit):
    clients that send slowly hold a connection each until their read timeout, and at a common
    default soft limit of 1024 a few hundred of them would leave no descriptor to accept anyone
    else with. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open files limit from %d to %d: %s", soft, wanted, exc)
    return soft
