"""The KV-transfer wire protocol: small typed control messages (msgpack via msgspec).

A decode instance (D) connects a DEALER to a prefill instance's (P) ROUTER KV port:

    D -> P  Hello(compat_hash, key)          P -> D  HelloAck | HelloReject(reason)
    D -> P  PullKV(req_id)                   (D has reserved blocks; "send when ready")
    P -> D  [KVHeader, frames...]            per KV layer (MTP included), K then V, one frame per run
                                             of consecutive blocks, straight from the cache's memory
    P -> D  KVError(req_id, reason)          (P cannot serve it: aborted, expired, unknown)
    D -> P  KVAck(req_id)                    (P frees its blocks)
    D -> P  KeepAlive(req_ids)               (renews P's lease on those requests)
    D -> P  Release(req_id)                  (D gave up: abort, reservation deadline)
    P -> D  HandshakeRequired(reason)        (P does not know this connection: it restarted at the same
                                             address, or D reconnected; D says Hello again, re-sends pulls)

Tensor payloads are raw frames sent without copying; nothing is pickled.
"""
from __future__ import annotations

import msgspec


class Hello(msgspec.Struct, tag=True):
    compat_hash: str
    description: str
    peer: str
    key: str = ""


class HelloAck(msgspec.Struct, tag=True):
    peer: str


class HelloReject(msgspec.Struct, tag=True):
    reason: str


class PullKV(msgspec.Struct, tag=True):
    req_id: str


class KVHeader(msgspec.Struct, tag=True):
    req_id: str
    num_tokens: int            # positions [0, num_tokens) are valid
    num_blocks: int
    t0: int                    # the handoff token sampled on P
    run_lengths: list[int]     # blocks per frame; frames go layer by layer, K then V, run by run
    block_shape: list[int]     # [block_size, kv_heads, head_dim]
    dtype: str


class KVError(msgspec.Struct, tag=True):
    req_id: str
    reason: str


class KVAck(msgspec.Struct, tag=True):
    req_id: str


class KeepAlive(msgspec.Struct, tag=True):
    req_ids: list[str]


class Release(msgspec.Struct, tag=True):
    req_id: str
    reason: str


class HandshakeRequired(msgspec.Struct, tag=True):
    reason: str


Message = (Hello | HelloAck | HelloReject | PullKV | KVHeader | KVError | KVAck | KeepAlive | Release
           | HandshakeRequired)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> Message:
    """Raises msgspec.DecodeError / ValidationError on malformed input."""
    return _decoder.decode(data)
