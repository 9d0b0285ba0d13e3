"""Prefill side (P): serve KV blocks to decode instances over a ROUTER socket.

A finished prefill's blocks are *held* under a lease (this is the only record of them: the
scheduler has forgotten the request). D's KeepAlive renews it, D's KVAck or
Release frees the blocks, and an expired lease frees them too, so a dead D never leaks memory.

Everything is keyed by the transfer's identity (request id, transfer id): a retry of the same
request is another transfer, and a message for one never touches the other. A transfer that
ended here (lease expired, aborted, replaced by a newer attempt) is remembered for a while, so a
decode instance that asks for it later gets a KVError at once instead of waiting out its deadline.

Two ways to ship the KV (`layerwise`, P's --kv-transfer-mode):
  after-prefill  the whole prompt's KV in one message once the prefill finished (`_send`);
  layerwise      each layer's KV of each chunk as the forward writes it (`publish_layer`), sent by
                 the thread that owns the KV port (layer_stream.py), then a small KVLayersDone when
                 the prefill finished. This thread keeps the protocol; the whole-transfer send is
                 still the answer to a pull from a connection the stream did not go to (D
                 re-handshaked), since D accepts either form for any pull.

Frames are small (at most MAX_FRAME_BYTES): a transfer larger than that goes as KVLayer pieces and
a KVLayersDone even after the prefill, and the stream splits big layer chunks. Two reasons: D sees
a long transfer arrive piece by piece, which is what its no-progress deadline watches, and every
frame crosses a slow link within the ZMTP heartbeat timeout (engine/sockets.py), which counts
only whole frames as traffic and would otherwise drop a connection that is busy carrying one.

Resuming (issue 44). After a reconnect ZMQ may have dropped what was queued for the old
connection (a ROUTER forgets a peer's queue when it disconnects), so D re-requests an unfinished
transfer with PullKV(resume=True, have=...), naming the position spans of each layer it already
holds. For a transfer whose prefill is over P answers by sending only the missing spans, from the
blocks it still holds under the lease; one still being computed is sent (the missing part of it)
once it is. Whatever D acknowledged is never sent again; at worst a piece that was in flight when
D asked arrives twice, which D accepts.
"""
from __future__ import annotations

import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import xxhash
import zmq

from engine.cluster_key import ClusterKey, check_bind
from engine.sockets import harden
from kv_transfer import messages as m
from kv_transfer.layer_stream import DoneJob, LayerJob, LayerStreamer
from kv_transfer.stats import TransferStats

logger = logging.getLogger(__name__)

Key = tuple[str, str]   # (req_id, transfer_id)
ENDED_MEMORY = 4096     # ended transfers remembered to answer late pulls
MAX_CONTROL_BYTES = 64 << 20  # the largest message D may send (a Hello with every tensor's fingerprint)
# The largest KV frame P sends. It must cross the slowest link we support (about 1 Mbit/s) well
# within the ZMTP heartbeat timeout (engine/sockets.py), and the no-progress deadline on D must
# be many times its transfer time; at fast links a frame this size still costs little per byte.
MAX_FRAME_BYTES = 256 << 10
Spans = dict[int, list[list[int]]]  # layer -> merged [start, end) positions (what D already holds)


@dataclass
class HeldKV:
    req_id: str
    block_ids: list[int]
    num_tokens: int
    t0: int
    deadline: float
    transfer_id: str = ""
    requester: bytes | None = None   # D's identity once it asked
    sent: bool = False
    streamed: bool = False           # layer-wise: the layers went (or go) out on the stream
    hidden: torch.Tensor | None = None  # the prompt's last positions' hidden states, sent instead of the MTP KV
    prefill_done_time: float = 0.0   # wall clock when the prompt's last KV layer was written (0: unknown)


@dataclass
class PendingPull:
    requester: bytes
    deadline: float
    have: Spans | None = None   # a resumed pull: what D holds already (send the rest)


@dataclass
class Transfer:
    """What P knows of one transfer, from the first thing it learns of it (a layer streamed, D's
    pull, the finished prefill) until it ends (acked, released, aborted, expired)."""

    held: HeldKV | None = None         # the finished prefill's blocks, under a lease
    pull: PendingPull | None = None    # D's pull that came before the prefill finished
    on_stream: bool = False            # layer-wise: layers of it were published to the stream
    first_puller: bytes | None = None  # layer-wise: the connection the stream goes to (the first pull's)

    def empty(self) -> bool:
        return self.held is None and self.pull is None and not self.on_stream and self.first_puller is None


def consecutive_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """[(first block, count)] for each run of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def tensor_frame(t: torch.Tensor) -> memoryview:
    """A host tensor's bytes as one frame (no copy)."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def missing(have: list[list[int]], n: int) -> list[tuple[int, int]]:
    """The [start, end) spans of [0, n) not covered by `have` (sorted, merged spans)."""
    out, at = [], 0
    for start, end in have:
        if start > at:
            out.append((at, min(start, n)))
        at = max(at, end)
    if at < n:
        out.append((at, n))
    return [(a, b) for a, b in out if a < b]


def frames_checksum(frames: list) -> int:
    """xxh3_64 over the frames' bytes in order: the same on both sides whatever the framing."""
    h = xxhash.xxh3_64()
    for f in frames:
        h.update(f)
    return h.intdigest()


class KVSender:
    def __init__(self, ctx: zmq.Context, bind_addr: str, kv_cache: torch.Tensor, compat_hash: str,
                 description: str, name: str, release_blocks: Callable[[str, list[int]], None], lease_s: float = 30.0,
                 key: str = "", checksum: bool = False, compare: Callable[[str], str] | None = None,
                 cluster_key: ClusterKey | None = None, layerwise: bool = False, draft_layers: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`compare(peer_description)` names what differs from a refused peer's layout (handshake.py);
        with `cluster_key` the port is CURVE-only: decode instances must hold the cluster key;
        `layerwise`: a thread owns the port and streams layers (`publish_layer`); `draft_layers`: the
        cache's last layers that are the MTP drafter's (left out of a transfer that hands over hidden states);
        `clock`: the monotonic clock leases run on (tests pass a fake one)."""
        self.clock = clock
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        router.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)  # D sends only small control messages
        # No cap on what waits to go out: it is bounded by the KV held under leases, and a ROUTER at
        # its high-water mark drops messages silently, which would lose pieces of a transfer.
        router.setsockopt(zmq.SNDHWM, 0)
        harden(router)
        check_bind(bind_addr, cluster_key, "prefill KV port")
        self.auth = None
        if cluster_key is not None:
            cluster_key.secure_server(router)
            self.auth = cluster_key.authenticator(ctx)
        router.bind(bind_addr)
        self.address = router.getsockopt_string(zmq.LAST_ENDPOINT)
        # Layer-wise: the stream thread owns the ROUTER from here on; this thread talks through it.
        self.streamer = LayerStreamer(ctx, router, name, checksum, MAX_FRAME_BYTES) if layerwise else None
        self.socket = self.streamer.engine_socket if self.streamer else router
        self.kv_cache = kv_cache
        self.draft_layers = draft_layers
        self.compat_hash, self.description, self.name = compat_hash, description, name
        self.release_blocks = release_blocks
        self.lease_s = lease_s
        self.key = key
        self.checksum = checksum
        self.compare = compare
        self.peers: set[bytes] = set()   # authenticated D identities
        self.transfers: dict[Key, Transfer] = {}
        self.ended: OrderedDict[Key, str] = OrderedDict()  # why a transfer ended, for late pulls
        self.stats = TransferStats()

    # -- engine-facing -------------------------------------------------------------------

    def hold(self, req_id: str, block_ids: list[int], num_tokens: int, t0: int, transfer_id: str = "",
             hidden: torch.Tensor | None = None, prefill_done_time: float = 0.0) -> None:
        """A prefill finished: keep its blocks until D takes them (or the lease runs out). `hidden`
        (on the host): the target's hidden states of the prompt's last positions, for D's MTP drafter
        in place of the MTP layers' KV. `prefill_done_time`: the wall clock when the forward of the
        prompt's last KV layer was over (what D measures the hand-off from; 0: unknown)."""
        # Older held attempts go; pending pulls stay: one for another attempt may be a newer retry
        # whose Submit this P has not read yet (it comes over the front end's link, the pull over ours).
        self.supersede(req_id, transfer_id, pulls=False)
        key = (req_id, transfer_id)
        held = HeldKV(req_id, block_ids, num_tokens, t0, self.clock() + self.lease_s, transfer_id, hidden=hidden,
                      prefill_done_time=prefill_done_time)
        transfer = self.transfers.setdefault(key, Transfer())
        pull, transfer.held, transfer.pull = transfer.pull, held, None
        if pull is not None:
            held.requester = pull.requester
        if transfer.on_stream and (pull is None or (pull.requester == transfer.first_puller and pull.have is None)):
            self._complete_stream(held)  # D gets it on the stream's route, as soon as that is known
        elif pull is not None:
            self._send(held, pull.have)

    def publish_layer(self, req_id: str, transfer_id: str, layer: int, start: int, end: int, num_tokens: int,
                      kv: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        """Layer-wise: `kv` ([2, end - start, heads, dim], a host copy) of prompt positions
        [start, end) of `layer` is written; queue it for the stream (never blocks)."""
        assert self.streamer is not None, "publish_layer needs a layer-wise sender"
        key = (req_id, transfer_id)
        self.transfers.setdefault(key, Transfer()).on_stream = True
        self.streamer.submit(LayerJob(key, layer, start, end, num_tokens, kv, ready))

    def end_stream(self, req_id: str, transfer_id: str) -> None:
        """The request finished here without a hand-off: drop whatever of it is still queued."""
        self._forget((req_id, transfer_id))

    def supersede(self, req_id: str, transfer_id: str, pulls: bool = True) -> None:
        """A new attempt `transfer_id` of `req_id` is ours now (its Submit arrived): release any older
        one at once — its blocks, and D's pending pull for it, which this P will never serve."""
        keys = [k for k, t in self.transfers.items() if t.held is not None or (pulls and t.pull is not None)]
        for key in [k for k in keys if k[0] == req_id and k[1] != transfer_id]:
            self._end(key, f"superseded by a newer attempt of request {req_id}")

    def drop(self, req_id: str, reason: str, transfer_id: str | None = None) -> None:
        """Abort from the server (of one attempt, or of every attempt when transfer_id is None):
        tell D (if it asked) and free."""
        keys = [k for k, t in self.transfers.items() if (t.held is not None or t.pull is not None)
                and k[0] == req_id and transfer_id in (None, k[1])]
        for key in keys:
            self._end(key, reason)

    def poll(self) -> None:
        """Handle every message waiting on the KV port, then expire leases. Nothing a peer sends
        may end the engine loop: a message that breaks a handler is dropped and counted."""
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                self._handle(frames)
            except Exception:
                self.stats.dropped_frames += 1
                logger.exception("dropping a KV-port message that broke its handler")
        self._expire()

    # -- protocol ------------------------------------------------------------------------

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.stats.dropped_frames += 1
            return
        identity, payload = frames
        try:
            msg = m.decode(payload)
        except Exception:  # malformed: drop and count, never crash the engine
            self.stats.dropped_frames += 1
            return
        if isinstance(msg, m.Hello):
            self._handshake(identity, msg)
            return
        if identity not in self.peers:
            self.stats.dropped_frames += 1
            # A well-formed message from a connection we never handshaked with: a D that knew the
            # previous process at this address (restart) or reconnected. Without this it would wait
            # out its whole reservation deadline on pulls nobody will ever answer.
            self._send_msg(identity, m.HandshakeRequired(f"prefill {self.name} does not know this connection: "
                                                         "say Hello again"))
            return
        if isinstance(msg, m.PullKV):
            self._on_pull(identity, (msg.req_id, msg.transfer_id), msg.have if msg.resume else None)
        elif isinstance(msg, m.KVAck):
            self._release((msg.req_id, msg.transfer_id))
        elif isinstance(msg, m.Release):  # also withdraws a pull that waits for the prefill
            self._release((msg.req_id, msg.transfer_id), withdraw=True)
        elif isinstance(msg, m.KeepAlive):
            self._on_keepalive(identity, msg)
        else:
            self.stats.dropped_frames += 1

    def _on_pull(self, identity: bytes, key: Key, have: Spans | None = None) -> None:
        """`have` (a resumed pull, else None): what D already holds of the transfer."""
        now = self.clock()
        transfer = self.transfers.get(key)
        held = transfer.held if transfer else None
        if held is None:
            if key in self.ended:  # it ended here already: say so now, not at D's deadline
                self._send_msg(identity, m.KVError(key[0], self.ended[key], key[1]))
                return
            transfer = self.transfers.setdefault(key, Transfer())
            if self.streamer is not None and transfer.first_puller is None:
                transfer.first_puller = identity  # the stream thread routes by the same rule
            earlier = transfer.pull
            if have is None and earlier is not None and earlier.have is not None:
                have = earlier.have  # still a resumed pull (a KeepAlive-era duplicate changes nothing)
            transfer.pull = PendingPull(identity, now + self.lease_s, have)
            return
        assert transfer is not None
        # A resumed pull, or a pull from a new connection (D re-handshaked after a reconnect): what
        # went to the old connection may be lost, so send again what D does not hold.
        resend = have is not None or (held.sent and held.requester != identity)
        if held.streamed and have is None:  # the stream follows the first pull; only another connection resends
            if transfer.first_puller is None:
                transfer.first_puller = identity
            resend = identity != transfer.first_puller
        held.requester = identity
        held.deadline = now + self.lease_s
        if resend and (held.sent or held.streamed):
            self.stats.transfers_resumed += 1
        if (not held.sent and not held.streamed) or resend:
            self._send(held, have)

    def _on_keepalive(self, identity: bytes, msg: m.KeepAlive) -> None:
        """Renew the leases of the transfers D still pulls, and tell it which ones are not computed yet
        (so that D does not count a long prefill queue as a stalled transfer)."""
        now = self.clock()
        tids = msg.transfer_ids if len(msg.transfer_ids) == len(msg.req_ids) else [""] * len(msg.req_ids)
        pending: list[Key] = []
        for key in zip(msg.req_ids, tids):
            transfer = self.transfers.get(key)
            if transfer is not None and transfer.held is not None:
                transfer.held.deadline = now + self.lease_s
            elif transfer is not None and transfer.pull is not None:
                transfer.pull.deadline = now + self.lease_s
                pending.append(key)
            elif key in self.ended:  # D missed our KVError (or it was sent before D asked)
                self._send_msg(identity, m.KVError(key[0], self.ended[key], key[1]))
        if pending:
            self._send_msg(identity, m.KVPending([k[0] for k in pending], [k[1] for k in pending]))

    def _handshake(self, identity: bytes, hello: m.Hello) -> None:
        if self.key and not hmac.compare_digest(hello.key.encode(), self.key.encode()):
            self.stats.handshakes_rejected += 1
            self._send_msg(identity, m.HelloReject("KV port key mismatch: set the same --kv-key on prefill and decode"))
            return
        if hello.compat_hash != self.compat_hash:
            self.stats.handshakes_rejected += 1
            diff = self.compare(hello.description) if self.compare else ""
            reason = (f"incompatible KV layout: prefill {self.name} and decode {hello.peer} differ in "
                      f"{diff or 'their layout'}")
            logger.error("refusing decode peer %s: %s", hello.peer, reason)
            self._send_msg(identity, m.HelloReject(reason))
            return
        self.peers.add(identity)
        if self.streamer is not None:  # before the HelloAck: the stream may trust this peer's pulls
            self.streamer.peer_ready(identity)
        self._send_msg(identity, m.HelloAck(self.name))

    def _send(self, held: HeldKV, have: Spans | None = None) -> None:
        """Send the transfer (or, resumed, what D lacks) to `held.requester`: in one message when it
        is small and whole, else in KVLayer pieces and a KVLayersDone."""
        assert held.requester is not None
        cache = self.kv_cache
        num_blocks = -(-held.num_tokens // cache.shape[3])
        token_bytes = 2 * cache.element_size() * cache[0, 0, 0, 0].numel()  # one position's K and V of a layer
        if have or token_bytes * held.num_tokens * self._num_layers(held) > MAX_FRAME_BYTES:
            self._send_pieces(held, have or {})
            return
        runs = consecutive_runs(held.block_ids[:num_blocks])
        # Zero-copy: each run of consecutive blocks of one layer's K (or V) is one contiguous slice
        # of the cache. The blocks stay held until D acks, so the memory is stable while ZMQ sends.
        frames = []
        for layer in range(self._num_layers(held)):
            for kv in (0, 1):
                for start, n in runs:
                    part = cache[layer, kv, start : start + n]
                    if part.device.type != "cpu":
                        part = part.cpu()
                    frames.append(tensor_frame(part))
        if held.hidden is not None:
            frames.append(tensor_frame(held.hidden))
        header = m.KVHeader(held.req_id, held.num_tokens, num_blocks, held.t0, [n for _, n in runs],
                            list(cache.shape[3:]), str(cache.dtype).removeprefix("torch."), held.transfer_id,
                            self.name, frames_checksum(frames) if self.checksum else None,
                            held.prefill_done_time, *self._hidden_fields(held),
                            sent_time=time.time())
        self.socket.send_multipart([held.requester, m.encode(header), *frames], copy=False)
        self._sent(held, sum(f.nbytes for f in frames))

    def _send_pieces(self, held: HeldKV, have: Spans) -> None:
        """Every layer's positions D does not hold, as KVLayer messages of at most MAX_FRAME_BYTES
        (gathered from the held blocks), then the KVLayersDone that completes the transfer."""
        cache, n = self.kv_cache, held.num_tokens
        block_size, heads, dim = cache.shape[3:]
        step = max(1, MAX_FRAME_BYTES // (2 * cache.element_size() * heads * dim))
        blocks = torch.tensor(held.block_ids[: -(-n // block_size)], dtype=torch.long)
        dtype = str(cache.dtype).removeprefix("torch.")
        sent = 0
        for layer in range(self._num_layers(held)):
            flat = cache[layer].view(2, -1, heads, dim)
            for lo, hi in missing(have.get(layer, []), n):
                for a in range(lo, hi, step):
                    b = min(a + step, hi)
                    pos = torch.arange(a, b)
                    slots = (blocks[pos // block_size] * block_size + pos % block_size).to(cache.device)
                    frame = tensor_frame(flat.index_select(1, slots).cpu())
                    msg = m.KVLayer(held.req_id, held.transfer_id, self.name, layer, a, b, n, dtype,
                                    frames_checksum([frame]) if self.checksum else None, time.time())
                    self.socket.send_multipart([held.requester, m.encode(msg), frame], copy=False)
                    sent += frame.nbytes
        frames = [tensor_frame(held.hidden)] if held.hidden is not None else []
        done = self._done_message(held)
        self.socket.send_multipart([held.requester, m.encode(done), *frames], copy=False)
        self._sent(held, sent + sum(f.nbytes for f in frames))

    def _sent(self, held: HeldKV, nbytes: int) -> None:
        if not held.sent:  # a resend is counted in transfers_resumed (by the caller), not as another transfer
            self.stats.transfers_sent += 1
        held.sent = True
        self.stats.bytes_sent += nbytes

    def _done_message(self, held: HeldKV) -> m.KVLayersDone:
        frames = [tensor_frame(held.hidden)] if held.hidden is not None else []
        return m.KVLayersDone(held.req_id, held.transfer_id, self.name, held.num_tokens, self._num_layers(held),
                              held.t0, held.prefill_done_time, *self._hidden_fields(held),
                              frames_checksum(frames) if frames and self.checksum else None, time.time())

    def _complete_stream(self, held: HeldKV) -> None:
        assert self.streamer is not None
        key = (held.req_id, held.transfer_id)
        frames = [tensor_frame(held.hidden)] if held.hidden is not None else []
        self.streamer.submit(DoneJob(key, self._done_message(held), frames))
        held.streamed = held.sent = True
        self.stats.transfers_sent += 1
        self.stats.bytes_sent += sum(f.nbytes for f in frames)  # the layers' bytes: the stream's own counter

    def _num_layers(self, held: HeldKV) -> int:
        """The KV layers the transfer carries: all, or the target's where hidden states stand in for the MTP's."""
        return self.kv_cache.shape[0] - (self.draft_layers if held.hidden is not None else 0)

    @staticmethod
    def _hidden_fields(held: HeldKV) -> tuple[int, str]:
        if held.hidden is None:
            return 0, ""
        return held.hidden.shape[0], str(held.hidden.dtype).removeprefix("torch.")

    def _forget(self, key: Key) -> None:
        """The transfer's stream is over here: drop its layer-wise state (and what the stream still holds)."""
        transfer = self.transfers.get(key)
        if transfer is not None:
            transfer.on_stream, transfer.first_puller = False, None
            if transfer.empty():
                del self.transfers[key]
        if self.streamer is not None:  # also when nothing was streamed: its route may be known there
            self.streamer.forget(key)

    def _release(self, key: Key, withdraw: bool = False) -> None:
        """D is done with the transfer: free its blocks (`withdraw`: and drop its waiting pull)."""
        self._forget(key)
        transfer = self.transfers.get(key)
        if transfer is None:
            return
        held, transfer.held = transfer.held, None
        if withdraw:
            transfer.pull = None
        if transfer.empty():
            del self.transfers[key]
        if held is not None:
            self.release_blocks(held.req_id, held.block_ids)

    def _end(self, key: Key, reason: str) -> None:
        """The transfer cannot be served any more: free its blocks, tell D if it asked, remember why."""
        self._forget(key)
        transfer = self.transfers.pop(key, None) or Transfer()
        held, pull = transfer.held, transfer.pull
        requester = held.requester if held else (pull.requester if pull else None)
        if requester is not None:
            self._send_msg(requester, m.KVError(key[0], reason, key[1]))
        if held is not None:
            self.release_blocks(key[0], held.block_ids)
        self.ended[key] = reason
        while len(self.ended) > ENDED_MEMORY:
            self.ended.popitem(last=False)

    def _send_msg(self, identity: bytes, msg: m.Message) -> None:
        try:
            self.socket.send_multipart([identity, m.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer is gone; its lease will expire

    def _expire(self) -> None:
        now = self.clock()
        for key, held in [(k, t.held) for k, t in self.transfers.items() if t.held and t.held.deadline < now]:
            self.stats.leases_expired += 1
            logger.warning("KV lease of %s expired (decode peer silent): freeing %d blocks", key[0],
                           len(held.block_ids))
            self._end(key, f"the KV lease on prefill {self.name} expired after {self.lease_s:g} s")
        for key in [k for k, t in self.transfers.items() if t.pull and t.pull.deadline < now]:
            self._end(key, f"prefill {self.name} never had the KV within {self.lease_s:g} s")

    def counters(self) -> dict[str, float]:
        out = self.stats.as_counters()
        if self.streamer is not None:  # written by the stream thread: read, never reset here
            out["kv_transfer_layers_sent"] = float(self.streamer.layers_sent)
            out["kv_transfer_bytes_sent"] += float(self.streamer.bytes_sent)
        return out

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()  # closes the ROUTER in its own thread
        else:
            self.socket.close(0)
        if self.auth is not None:
            self.auth.stop()
