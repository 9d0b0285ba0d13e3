"""Server <-> engine messages (msgpack via msgspec): requests and aborts in, outputs and heartbeats out."""
from __future__ import annotations

import msgspec

from engine.types import EngineRole, FinishReason, SamplingParams, TokenLogprobs


class Submit(msgspec.Struct, tag=True):
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams             # validated again when decoded
    kv_endpoint: str = ""              # decode role: P's KV address (Heartbeat.kv_endpoint), to pull the KV from
    transfer_id: str = ""              # PD: this attempt's KV transfer (the same on P and D; new on a retry)
    output_token_ids: list[int] = []   # failover: tokens already streamed to the client; go on after them


class Abort(msgspec.Struct, tag=True):
    req_id: str
    transfer_id: str = ""              # the attempt aborted ("": whichever the engine has)


class Shutdown(msgspec.Struct, tag=True):
    pass


class Output(msgspec.Struct, tag=True):
    instance: str
    req_id: str
    token_ids: list[int]
    # Position of token_ids[0] among the request's outputs: t0 (from P) and D's tokens travel on
    # different sockets, so the front end restores their order with it.
    first_index: int = 0
    logprobs: list[TokenLogprobs] = []
    finish_reason: FinishReason | None = None  # stop | length | abort | error (never handed_off)
    error: str | None = None
    retryable: bool = False            # error that a fresh prefill may fix (KV transfer failed)
    queue_time: float | None = None
    transfer_id: str = ""              # PD: the attempt this output belongs to (late ones of old attempts are dropped)
    # With the first output token only (t0; from P under PD): the prompt's logprobs, when asked for
    # (tokens 1.., the first has none), and how many prompt tokens the prefix cache served.
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int | None = None


class Heartbeat(msgspec.Struct, tag=True):
    instance: str
    role: EngineRole
    kv_endpoint: str                   # prefill role: its KV address, where decode instances pull from ("": none)
    kv_blocks_free: int
    kv_blocks_total: int
    num_running: int
    num_waiting: int
    counters: dict[str, float]                          # monotonically increasing, by metric name
    per_position: dict[str, list[float]] = {}           # counters with one value per draft position
    # Liveness, sent by the engine's heartbeat thread whatever its loop is doing (engine/loop_watch.py):
    state: str = "ok"                  # a LoopState: starting | ok | busy | stalled | draining
    busy_s: float = 0.0                # how long the step in progress has been running (0: between steps)
    step_p99_s: float = 0.0            # p99 of the engine's recent step durations
    stall_after_s: float = 0.0         # a step longer than this is reported as stalled


class Leaving(msgspec.Struct, tag=True):
    """An engine is going away (SIGTERM): route nothing more to it. Its requests come back as
    retryable errors right after this message, so the front end resumes them elsewhere at once."""

    instance: str
    reason: str


class _SubmitId(msgspec.Struct, tag="Submit"):
    """Just the id of a Submit, to answer one whose body does not validate."""

    req_id: str


ToEngine = Submit | Abort | Shutdown
FromEngine = Output | Heartbeat | Leaving

_enc = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)
_submit_id = msgspec.msgpack.Decoder(_SubmitId)


def encode(msg: ToEngine | FromEngine) -> bytes:
    return _enc.encode(msg)


def decode_to_engine(data: bytes) -> ToEngine:
    """Raises msgspec.DecodeError / ValidationError on malformed input (bad sampling params too)."""
    return _to_engine.decode(data)


def submit_id(data: bytes) -> str | None:
    """The request id of a Submit that `decode_to_engine` refused, or None if it is not one."""
    try:
        return _submit_id.decode(data).req_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine.decode(data)
