"""The KV-transfer wire protocol: small typed control messages (msgpack via msgspec).

A decode instance (D) connects a DEALER to a prefill instance's (P) ROUTER KV port:

    D -> P  Hello(compat_hash, key)          P -> D  HelloAck | HelloReject(reason)
    D -> P  PullKV(req_id, transfer_id, have, resume)  (D has reserved blocks; "send when ready". A
                                             re-request after a reconnect or a silence has resume=True
                                             and names in `have` the KV D already holds: P sends the rest)
    P -> D  [KVHeader, frames...]            per KV layer (MTP included), K then V, one frame per run
                                             of consecutive blocks, straight from the cache's memory;
                                             with `hidden_positions` the MTP layers are left out and one
                                             more frame follows: the target's hidden states of the
                                             prompt's last positions (below)
  layer-wise mode (P's --kv-transfer-mode layerwise), instead of the KVHeader:
    P -> D  [KVLayer, frame]                 one layer's K and V of prompt positions [start, end), sent
                                             as soon as P's forward wrote them (any order, repeats allowed)
    P -> D  [KVLayersDone, (hidden frame)]   after the last layer: D admits once every layer covers
                                             [0, num_tokens) (a full KVHeader is also accepted instead)
  the same KVLayer/KVLayersDone form also carries an after-prefill transfer too large for one message
  (a frame is at most sender.MAX_FRAME_BYTES) and what a resumed transfer still lacks
    P -> D  KVPending(req_ids, transfer_ids) (answers a KeepAlive: P has not computed these yet; D
                                             counts it as progress, so a long prefill queue is no stall)
    P -> D  KVError(req_id, transfer_id, reason)  (P cannot serve it: aborted, lease expired, replaced)
    D -> P  KVAck(req_id, transfer_id)       (P frees its blocks)
    D -> P  KeepAlive(req_ids, transfer_ids) (renews P's lease on those transfers)
    D -> P  Release(req_id, reason, transfer_id)  (D gave up, or got a transfer it did not expect)
    P -> D  HandshakeRequired(reason)        (P does not know this connection: it restarted at the same
                                             address, or D reconnected; D says Hello again, re-sends pulls)

Every transfer has an identity: the request id, the transfer id the front end chose for this
attempt (a retry of the same request gets a new one), and the P instance (the connection it came
on and the `sender` name in the header). Either side acts only on messages for the transfer it
expects; anything else is dropped, counted and, where the peer holds memory for it, answered.

With a windowed MTP drafter (mtp_window) P does not run the MTP layer over the prompt: it sends
the target's hidden states of the prompt's last `hidden_positions` positions ([n, hidden_size] of
`hidden_dtype`) instead of the MTP layers' KV, and D's drafter runs the layer over them the first
time it drafts for the request (under load it may never do).

Tensor payloads are raw frames sent without copying; nothing is pickled.
"""
from __future__ import annotations

import msgspec


class Hello(msgspec.Struct, tag=True):
    compat_hash: str
    description: str       # JSON of the compatibility description, so a refusal can name what differs
    peer: str
    key: str = ""


class HelloAck(msgspec.Struct, tag=True):
    peer: str


class HelloReject(msgspec.Struct, tag=True):
    reason: str


class PullKV(msgspec.Struct, tag=True):
    req_id: str
    transfer_id: str = ""
    # What D already holds, layer -> merged [start, end) position spans (a resumed layer-wise
    # transfer); P sends only the rest. Empty: everything.
    have: dict[int, list[list[int]]] = {}
    resume: bool = False       # a re-request (after a reconnect or a silence): send again what is missing


class KVHeader(msgspec.Struct, tag=True):
    req_id: str
    num_tokens: int            # positions [0, num_tokens) are valid: the prompt
    num_blocks: int            # ceil(num_tokens / block_size)
    t0: int                    # the handoff token sampled on P
    run_lengths: list[int]     # blocks per frame; frames go layer by layer, K then V, run by run
    block_shape: list[int]     # [block_size, kv_heads, head_dim]
    dtype: str
    transfer_id: str = ""
    sender: str = ""           # P's instance name
    checksum: int | None = None  # xxh3_64 of every frame's bytes in order; None: not computed
    prefill_done_time: float = 0.0  # wall clock when P finished the forward of the last KV layer (0: unknown)
    hidden_positions: int = 0  # > 0: no MTP layers' KV; the hidden states of the last n positions follow
    hidden_dtype: str = ""
    sent_time: float = 0.0     # wall clock when P handed the message to its socket (transfer latency)


class KVLayer(msgspec.Struct, tag=True):
    """One frame follows: `[2 (K, V), end - start, kv_heads, head_dim]` of `dtype`, positions in order."""

    req_id: str
    transfer_id: str
    sender: str
    layer: int
    start: int
    end: int
    num_tokens: int            # the prompt's length: positions [0, num_tokens) make the transfer
    dtype: str
    checksum: int | None = None  # xxh3_64 of the frame; None: not computed
    sent_time: float = 0.0       # as in KVHeader


class KVLayersDone(msgspec.Struct, tag=True):
    req_id: str
    transfer_id: str
    sender: str
    num_tokens: int
    num_layers: int            # every one of them must cover [0, num_tokens) before D admits
    t0: int
    prefill_done_time: float = 0.0
    hidden_positions: int = 0  # as in KVHeader (the MTP layers are then not among num_layers)
    hidden_dtype: str = ""
    hidden_checksum: int | None = None  # xxh3_64 of the hidden frame; None: not computed
    sent_time: float = 0.0


class KVPending(msgspec.Struct, tag=True):
    """P's answer to a KeepAlive: of the transfers it names, these P has not finished computing."""

    req_ids: list[str]
    transfer_ids: list[str]


class KVError(msgspec.Struct, tag=True):
    req_id: str
    reason: str
    transfer_id: str = ""
    retryable: bool = True     # a fresh prefill may succeed (lease expired, P aborted or replaced it)


class KVAck(msgspec.Struct, tag=True):
    req_id: str
    transfer_id: str = ""


class KeepAlive(msgspec.Struct, tag=True):
    req_ids: list[str]
    transfer_ids: list[str] = []   # parallel to req_ids


class Release(msgspec.Struct, tag=True):
    req_id: str
    reason: str
    transfer_id: str = ""


class HandshakeRequired(msgspec.Struct, tag=True):
    reason: str


Message = (Hello | HelloAck | HelloReject | PullKV | KVHeader | KVLayer | KVLayersDone | KVPending | KVError | KVAck
           | KeepAlive | Release | HandshakeRequired)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> Message:
    """Raises msgspec.DecodeError / ValidationError on malformed input."""
    return _decoder.decode(data)
