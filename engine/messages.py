"""Server <-> engine messages (msgpack via msgspec): requests and aborts in, outputs and heartbeats out."""
from __future__ import annotations

import msgspec


class Submit(msgspec.Struct, tag=True):
    req_id: str
    prompt_token_ids: list[int]
    params: dict                       # SamplingParams fields
    prefill_endpoint: str = ""         # decode role: where to pull the KV from


class Abort(msgspec.Struct, tag=True):
    req_id: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class Output(msgspec.Struct, tag=True):
    instance: str
    req_id: str
    token_ids: list[int]
    # Position of token_ids[0] among the request's outputs: t0 (from P) and D's tokens travel on
    # different sockets, so the front end restores their order with it.
    first_index: int = 0
    logprobs: list[tuple[int, float, int, list[tuple[int, float]]]] = []  # (token, logprob, rank, top)
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    error: str | None = None
    retryable: bool = False            # error that a fresh prefill may fix (KV transfer failed)
    queue_time: float | None = None


class Heartbeat(msgspec.Struct, tag=True):
    instance: str
    role: str
    kv_endpoint: str
    kv_blocks_free: int
    kv_blocks_total: int
    num_running: int
    num_waiting: int
    counters: dict[str, float]


ToEngine = Submit | Abort | Shutdown
FromEngine = Output | Heartbeat

_enc = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(msg: ToEngine | FromEngine) -> bytes:
    return _enc.encode(msg)


def decode_to_engine(data: bytes) -> ToEngine:
    return _to_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine.decode(data)
