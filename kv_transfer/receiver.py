"""Decode side (D): pull KV blocks from prefill instances into reserved blocks.

One DEALER per prefill endpoint, handshaked on first use. A pull that stops making progress
(P died, P unreachable) fails after a bound with a clear reason and P is told to release (below).

A pull expects one transfer: (request id, transfer id) from the P at its endpoint. A header or
error for anything else (an old attempt, another P, a request D never reserved) is dropped and
counted, and answered with a Release so that a P holding blocks for it frees them now. A header
for the expected transfer is validated against the reservation — token and block counts, t0,
frame count and sizes, checksum — before a byte is written into KV memory.
A layer-wise transfer (KVLayer messages, then KVLayersDone) is validated the same way, message by
message, and lands as it comes: the pull completes once the done message is in and every layer
(target and MTP) covers the prompt's positions, whatever order the layers came in. Where P hands
over the target's hidden states of the prompt's last positions instead of the MTP layers' KV
(messages.py), the pull lands without those layers and the hidden states go on to the drafter.
A refused handshake is tried again with a backoff, so a P restarted with the right key or model
is used again without restarting D.

Deadlines follow progress, not the wall clock (issue 44). A pull is given up only when it has
seen no progress for `deadline_s` (--kv-deadline-s); progress is any KV message arriving from its
P (for this transfer or one queued ahead of it on the same connection: on a slow link they share
the pipe), or P's word (KVPending, its answer to our KeepAlive) that it is still computing the KV.
So a transfer that keeps receiving bytes is never abandoned however long it takes, and neither is
one waiting behind a long prefill queue, while one from a P that went silent is.

Resuming: ZMQ may lose what was in flight when a connection breaks (P's ROUTER drops a
disconnected peer's queue). A monitor on each DEALER reports the reconnect; D then says Hello
again and re-requests every unfinished pull with PullKV(resume=True, have=<the layers' position
spans already landed>), and P sends only the rest (sender.py). A pull silent for RESUME_AFTER_S
without a visible reconnect is re-requested the same way. KV that landed stays where it is: a
resumed transfer completes from whatever of it arrived, before or after the break.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.cluster_key import ClusterKey
from engine.sockets import HEARTBEAT_TIMEOUT_MS, harden
from kv_transfer import messages as m
from kv_transfer.sender import frames_checksum
from kv_transfer.stats import TransferStats

logger = logging.getLogger(__name__)

HIDDEN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KEEPALIVE_S = 1.0
# A pull with no progress for this long is asked for again (what is missing only). Longer than the
# ZMTP heartbeat timeout, so that a broken connection is normally noticed (and resumed) first, and
# longer than P's KVPending answers take to come back while P is busy with a step.
RESUME_AFTER_S = HEARTBEAT_TIMEOUT_MS / 1000 + 2.0
MONITOR_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
DATA_MESSAGES = (m.KVHeader, m.KVLayer, m.KVLayersDone)
REJECT_BACKOFF_S = 1.0       # first wait before saying Hello again to a peer that refused us
REJECT_BACKOFF_MAX_S = 30.0  # doubled on each refusal up to this


@dataclass
class Pull:
    req_id: str
    endpoint: str
    block_ids: list[int]
    started: float
    progress_at: float              # the last sign of progress (start, KV from its P, P's KVPending)
    requested: bool = False
    requests: int = 0               # PullKVs sent: every one after the first is a resume
    last_request: float = 0.0
    first_sent: float = 0.0         # P's wall clock when it sent the first KV message that arrived
    first_data_at: float = 0.0      # monotonic, here: when that message arrived
    transfer_id: str = ""
    num_tokens: int | None = None   # the reserved request's prompt length, when known
    covered: dict[int, list[list[int]]] = field(default_factory=dict)  # layer-wise: layer -> merged [start, end)s
    layers_done: m.KVLayersDone | None = None
    hidden: torch.Tensor | None = None  # layer-wise: the hidden states that came with the done message


@dataclass
class Completed:
    req_id: str
    t0: int
    num_tokens: int
    prefill_done_time: float = 0.0  # wall clock when P finished the last KV layer's forward (0: unknown)
    hidden: torch.Tensor | None = None  # the target's hidden states of the last positions, for the MTP drafter


@dataclass
class Failed:
    req_id: str
    reason: str
    retryable: bool = True   # a fresh prefill may fix it


@dataclass
class Peer:
    socket: zmq.Socket
    endpoint: str = ""
    state: str = "connecting"   # connecting -> ready | rejected (-> connecting again after the backoff)
    reason: str = ""
    name: str = ""              # the P instance's name, from its HelloAck
    pulls: set[str] = field(default_factory=set)
    last_keepalive: float = 0.0
    retry_at: float = 0.0       # rejected: when to say Hello again
    backoff: float = 0.0        # the next wait after a refusal (0: the first, REJECT_BACKOFF_S)
    monitor: zmq.Socket | None = None  # connection events of `socket`
    connected: bool = False     # the connection is up (ZMTP handshake done, no disconnect since)
    ever_connected: bool = False
    progress_at: float = 0.0    # when the last KV message of any transfer arrived from this P


class KVReceiver:
    def __init__(self, ctx: zmq.Context, kv_cache: torch.Tensor, compat_hash: str, description: str, name: str,
                 deadline_s: float = 30.0, key: str = "", vocab_size: int | None = None,
                 verify_checksums: bool = True, cluster_key: ClusterKey | None = None, draft_layers: int = 0,
                 hidden_size: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        """`deadline_s`: give up a pull after this long without progress (module docstring);
        `draft_layers`: the cache's last layers that are the MTP drafter's; `hidden_size`: the
        model's (both for transfers that hand over hidden states instead of those layers' KV);
        `clock`: the monotonic clock deadlines run on (tests pass a fake one)."""
        self.clock = clock
        self.ctx = ctx
        self.draft_layers, self.hidden_size = draft_layers, hidden_size
        self.cluster_key = cluster_key  # CURVE: prove we hold the cluster key, check that P does
        self.kv_cache = kv_cache
        self.compat_hash, self.description, self.name = compat_hash, description, name
        self.deadline_s = deadline_s
        self.key = key
        self.vocab_size = vocab_size
        self.verify_checksums = verify_checksums
        self.peers: dict[str, Peer] = {}
        self.pulls: dict[str, Pull] = {}
        self.stats = TransferStats()
        self.dtype_name = str(kv_cache.dtype).removeprefix("torch.")

    def start(self, req_id: str, endpoint: str, block_ids: list[int], transfer_id: str = "",
              num_tokens: int | None = None) -> None:
        if req_id in self.pulls:  # the same id again: the old pull is over, whatever it was
            self.cancel(req_id, "replaced by a new pull of the same request")
        now = self.clock()
        pull = Pull(req_id, endpoint, block_ids, now, now, transfer_id=transfer_id, num_tokens=num_tokens)
        self.pulls[req_id] = pull
        peer = self._peer(endpoint)
        peer.pulls.add(req_id)
        if peer.state == "ready":
            self._request(peer, pull)
        elif peer.state == "rejected" and now >= peer.retry_at:
            logger.info("saying Hello again to prefill %s, which refused us before", endpoint)
            self._rehandshake(peer)

    def cancel(self, req_id: str, reason: str, transfer_id: str | None = None) -> None:
        """Give up a pull (of that transfer only, when `transfer_id` is given) and tell P to release."""
        pull = self.pulls.get(req_id)
        if pull is None or transfer_id not in (None, pull.transfer_id):
            return
        self._end(pull)
        peer = self.peers.get(pull.endpoint)
        if peer is not None:
            self._send(peer, m.Release(req_id, reason, pull.transfer_id))

    def release(self, req_id: str, endpoint: str, transfer_id: str, reason: str) -> None:
        """Tell the P at `endpoint` to free a transfer D will never pull (a reservation that failed)."""
        self._send(self._peer(endpoint), m.Release(req_id, reason, transfer_id))

    def sockets(self) -> list[zmq.Socket]:
        return [s for p in self.peers.values() for s in (p.socket, p.monitor) if s is not None]

    def poll(self) -> tuple[list[Completed], list[Failed]]:
        done: list[Completed] = []
        failed: list[Failed] = []
        for peer in list(self.peers.values()):
            self._connection_events(peer)
            while True:
                try:
                    frames = peer.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    self._handle(peer, frames, done, failed)
                except Exception:  # nothing a peer sends may end the engine loop
                    self.stats.dropped_frames += 1
                    logger.exception("dropping a KV message from %s that broke its handler", peer.endpoint)
        self._housekeeping(failed)
        return done, failed

    # -- protocol ------------------------------------------------------------------------

    def _peer(self, endpoint: str) -> Peer:
        peer = self.peers.get(endpoint)
        if peer is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # No frame from P is ever larger than one layer's K (or V) of the whole cache: a bigger one
            # is hostile, and ZMQ drops the connection before allocating it.
            sock.setsockopt(zmq.MAXMSGSIZE, self.kv_cache[0, 0].numel() * self.kv_cache.element_size() + (1 << 20))
            harden(sock)
            if self.cluster_key is not None:
                self.cluster_key.secure_client(sock)
            monitor = sock.get_monitor_socket(MONITOR_EVENTS)
            sock.connect(endpoint)
            # The Hello counts as the first "keepalive".
            peer = Peer(sock, endpoint, last_keepalive=self.clock(), monitor=monitor)
            self.peers[endpoint] = peer
            self._hello(peer)
        return peer

    def _connection_events(self, peer: Peer) -> None:
        """A connection to P that comes back after a break: say Hello again and resume its pulls
        (what P had queued for the old connection may be lost)."""
        while peer.monitor is not None and peer.monitor.poll(0):
            event = recv_monitor_message(peer.monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED and peer.connected:
                peer.connected = False
                logger.warning("KV connection to prefill %s lost: %d pulls wait for it to come back",
                               peer.endpoint, len(peer.pulls))
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                peer.connected, reconnected = True, peer.ever_connected
                peer.ever_connected = True
                if reconnected and peer.state != "rejected":
                    self.stats.reconnects += 1
                    logger.warning("KV connection to prefill %s is back: resuming %d pulls", peer.endpoint,
                                   len(peer.pulls))
                    self._rehandshake(peer)

    def _hello(self, peer: Peer) -> None:
        self._send(peer, m.Hello(self.compat_hash, self.description, self.name, self.key))

    def _rehandshake(self, peer: Peer) -> None:
        """Say Hello again; pulls not yet answered are re-sent once the HelloAck arrives."""
        peer.state = "connecting"
        peer.last_keepalive = self.clock()
        for req_id in peer.pulls:
            if req_id in self.pulls:
                self.pulls[req_id].requested = False
        self._hello(peer)

    def _request(self, peer: Peer, pull: Pull) -> None:
        """Ask P for the transfer; again (resume): for what of it has not landed here."""
        resume = pull.requests > 0
        if resume:
            self.stats.transfers_resumed += 1
        self._send(peer, m.PullKV(pull.req_id, pull.transfer_id, pull.covered if resume else {}, resume))
        pull.requested = True
        pull.requests += 1
        pull.last_request = self.clock()

    def _end(self, pull: Pull) -> None:
        """The pull is over (landed, failed, cancelled): forget it everywhere, so no KeepAlive renews it."""
        if self.pulls.get(pull.req_id) is pull:
            del self.pulls[pull.req_id]
        peer = self.peers.get(pull.endpoint)
        if peer is not None:
            peer.pulls.discard(pull.req_id)

    def _expected(self, peer: Peer, req_id: str, transfer_id: str, sender: str | None = None) -> Pull | None:
        """The pull this message belongs to, if it is the transfer D expects from this peer."""
        pull = self.pulls.get(req_id)
        if pull is None or pull.transfer_id != transfer_id or pull.endpoint != peer.endpoint:
            return None
        if sender is not None and peer.name and sender != peer.name:
            return None
        return pull

    def _handle(self, peer: Peer, frames: list, done: list[Completed], failed: list[Failed]) -> None:
        try:
            msg = m.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.stats.dropped_frames += 1
            return
        if isinstance(msg, DATA_MESSAGES):
            self._progress(peer, msg)
        if isinstance(msg, m.KVPending):
            for req_id, transfer_id in zip(msg.req_ids, msg.transfer_ids):
                pull = self._expected(peer, req_id, transfer_id)
                if pull is not None:
                    pull.progress_at = self.clock()
        elif isinstance(msg, m.KVHeader):
            self._on_header(peer, msg, frames[1:], done, failed)
        elif isinstance(msg, m.KVLayer):
            self._on_layer(peer, msg, frames[1:], done, failed)
        elif isinstance(msg, m.KVLayersDone):
            self._on_layers_done(peer, msg, frames[1:], done, failed)
        elif isinstance(msg, m.KVError):
            self._on_error(peer, msg, failed)
        elif len(frames) != 1:  # control messages are one frame
            self.stats.dropped_frames += 1
        elif isinstance(msg, m.HelloAck) and peer.state == "connecting":
            peer.state, peer.name, peer.backoff = "ready", msg.peer, 0.0
            for req_id in list(peer.pulls):
                if req_id in self.pulls and not self.pulls[req_id].requested:
                    self._request(peer, self.pulls[req_id])
        elif isinstance(msg, m.HandshakeRequired) and peer.state != "rejected":
            if peer.state == "ready":  # every message sent meanwhile bounces: re-handshake once
                logger.warning("prefill %s lost our handshake (restarted?): saying Hello again", peer.endpoint)
                self._rehandshake(peer)
        elif isinstance(msg, m.HelloReject) and peer.state == "connecting":
            self._rejected(peer, msg.reason)
        else:
            self.stats.dropped_unexpected += 1

    def _progress(self, peer: Peer, msg: m.KVHeader | m.KVLayer | m.KVLayersDone) -> None:
        """KV arrived from P: the connection moves, and so do the pulls waiting on it."""
        now = self.clock()
        peer.progress_at = now
        pull = self._expected(peer, msg.req_id, msg.transfer_id)
        if pull is not None:
            pull.progress_at = now
            if not pull.first_data_at:
                pull.first_sent, pull.first_data_at = msg.sent_time, now

    def _rejected(self, peer: Peer, reason: str) -> None:
        peer.state, peer.reason = "rejected", reason
        wait = peer.backoff or REJECT_BACKOFF_S
        peer.retry_at = self.clock() + wait
        peer.backoff = min(wait * 2, REJECT_BACKOFF_MAX_S)
        self.stats.handshakes_rejected += 1
        logger.error("prefill %s refused the handshake: %s (trying again in %.0f s at the earliest)",
                     peer.endpoint, reason, peer.retry_at - self.clock())

    def _on_header(self, peer: Peer, header: m.KVHeader, frames: list, done: list[Completed],
                   failed: list[Failed]) -> None:
        pull = self._expected(peer, header.req_id, header.transfer_id, header.sender)
        if pull is None:
            # Not the transfer we wait for (an old attempt, a cancelled pull, a duplicate): if P is
            # holding blocks for it, it can free them now instead of at the end of its lease.
            self.stats.dropped_unexpected += 1
            self._send(peer, m.Release(header.req_id, "decode does not expect this transfer", header.transfer_id))
            return
        self._end(pull)
        error = self._validate(pull, header, frames)
        if error:
            self._invalid(peer, pull, error, failed)
            return
        hidden = None
        if header.hidden_positions:
            hidden = self._hidden(frames[-1], header.hidden_positions, header.hidden_dtype)
            self.stats.bytes_received += len(frames[-1].buffer)
            frames = frames[:-1]
        self._write(pull, header, frames)
        self._landed(peer, pull, Completed(header.req_id, header.t0, header.num_tokens, header.prefill_done_time,
                                           hidden), done)

    def _invalid(self, peer: Peer, pull: Pull, error: str, failed: list[Failed]) -> None:
        """The expected transfer sent something that does not fit: it fails (a fresh prefill may work)."""
        self._end(pull)
        self.stats.transfers_failed += 1
        self.stats.transfers_invalid += 1
        logger.warning("%s", error)
        self._send(peer, m.Release(pull.req_id, error, pull.transfer_id))
        failed.append(Failed(pull.req_id, error))

    def _landed(self, peer: Peer, pull: Pull, item: Completed, done: list[Completed]) -> None:
        self._end(pull)
        self._send(peer, m.KVAck(pull.req_id, pull.transfer_id))
        self.stats.transfers_received += 1
        # From P sending the first KV byte to the last one landing here: P's wall clock where it said
        # (meaningful on one host or NTP-close hosts), else from the first KV message's arrival.
        if pull.first_sent:
            latency = max(0.0, time.time() - pull.first_sent)
        else:
            latency = self.clock() - (pull.first_data_at or pull.started)
        self.stats.latency_seconds_sum += latency
        self.stats.latency_seconds_count += 1
        done.append(item)

    # -- layer-wise ----------------------------------------------------------------------

    def _on_layer(self, peer: Peer, msg: m.KVLayer, frames: list, done: list[Completed],
                  failed: list[Failed]) -> None:
        pull = self._expected(peer, msg.req_id, msg.transfer_id, msg.sender)
        if pull is None:  # a cancelled or finished pull's stream still flowing: no answer needed
            self.stats.dropped_unexpected += 1
            return
        error = self._validate_layer(pull, msg, frames)
        if error:
            self._invalid(peer, pull, error, failed)
            return
        self._write_layer(pull, msg, frames[0].buffer)
        pull.num_tokens = msg.num_tokens
        cover(pull.covered.setdefault(msg.layer, []), msg.start, msg.end)
        self.stats.layers_received += 1
        self._maybe_complete(peer, pull, done)

    def _on_layers_done(self, peer: Peer, msg: m.KVLayersDone, frames: list, done: list[Completed],
                        failed: list[Failed]) -> None:
        pull = self._expected(peer, msg.req_id, msg.transfer_id, msg.sender)
        if pull is None:  # as for a stray header: P holds blocks for it, which it may free now
            self.stats.dropped_unexpected += 1
            self._send(peer, m.Release(msg.req_id, "decode does not expect this transfer", msg.transfer_id))
            return
        what = f"malformed layer-wise KV transfer for {pull.req_id} from {pull.endpoint}"
        error = self._token_count_error(pull, msg.num_tokens, what)
        layers = self._num_layers(msg.hidden_positions)
        if msg.num_layers != layers:
            error = f"{what}: {msg.num_layers} layers, expected {layers}"
        elif self.vocab_size is not None and not 0 <= msg.t0 < self.vocab_size:
            error = f"{what}: t0={msg.t0} is outside the vocabulary [0, {self.vocab_size})"
        elif len(frames) != (1 if msg.hidden_positions else 0):
            error = f"{what}: {len(frames)} frames after the done message"
        elif msg.hidden_positions:
            error = self._hidden_error(msg.hidden_positions, msg.num_tokens, msg.hidden_dtype, frames[0], what)
            if (not error and msg.hidden_checksum is not None and self.verify_checksums
                    and frames_checksum([frames[0].buffer]) != msg.hidden_checksum):
                self.stats.checksum_mismatches += 1
                error = f"corrupted hidden states for {pull.req_id} from {pull.endpoint}: checksum mismatch"
        if error:
            self._invalid(peer, pull, error, failed)
            return
        if msg.hidden_positions:
            pull.hidden = self._hidden(frames[0], msg.hidden_positions, msg.hidden_dtype)
            self.stats.bytes_received += len(frames[0].buffer)
        pull.num_tokens, pull.layers_done = msg.num_tokens, msg
        self._maybe_complete(peer, pull, done)

    def _maybe_complete(self, peer: Peer, pull: Pull, done: list[Completed]) -> None:
        """Admit once the done message is in and every layer covers [0, num_tokens)."""
        fin = pull.layers_done
        if fin is None:
            return
        whole = [[0, fin.num_tokens]]
        if all(pull.covered.get(layer) == whole for layer in range(fin.num_layers)):
            self._landed(peer, pull, Completed(pull.req_id, fin.t0, fin.num_tokens, fin.prefill_done_time,
                                               pull.hidden), done)

    def _num_layers(self, hidden_positions: int) -> int:
        """The KV layers a transfer carries: all, or the target's where hidden states stand in for the MTP's."""
        return self.kv_cache.shape[0] - (self.draft_layers if hidden_positions else 0)

    def _hidden_error(self, n: int, num_tokens: int, dtype: str, frame, what: str) -> str | None:
        """Why a hidden-states frame does not fit, or None."""
        if not self.draft_layers or not 0 < n <= num_tokens:
            return f"{what}: hidden states of {n} positions of {num_tokens} (MTP layers here: {self.draft_layers})"
        if dtype not in HIDDEN_DTYPES:
            return f"{what}: hidden states of dtype {dtype!r}"
        if len(frame.buffer) != n * self.hidden_size * HIDDEN_DTYPES[dtype].itemsize:
            return f"{what}: the hidden states of {n} positions are {len(frame.buffer)} bytes"
        return None

    def _hidden(self, frame, n: int, dtype: str) -> torch.Tensor:
        # (a copy: the frame's memory belongs to ZMQ)
        return torch.frombuffer(frame.buffer, dtype=torch.uint8).view(HIDDEN_DTYPES[dtype]).view(n, -1).clone()

    def _token_count_error(self, pull: Pull, num_tokens: int, what: str) -> str | None:
        block_size = self.kv_cache.shape[3]
        if pull.num_tokens is not None and num_tokens != pull.num_tokens:
            return f"{what}: {num_tokens} tokens, the reserved prompt has {pull.num_tokens}"
        if num_tokens < 1 or -(-num_tokens // block_size) > len(pull.block_ids):
            return f"{what}: {num_tokens} tokens do not fit its {len(pull.block_ids)} reserved blocks"
        return None

    def _validate_layer(self, pull: Pull, msg: m.KVLayer, frames: list) -> str | None:
        """Why one layer's message does not fit the reservation, or None. Runs before any write."""
        cache = self.kv_cache
        what = f"malformed layer-wise KV transfer for {pull.req_id} from {pull.endpoint}"
        error = self._token_count_error(pull, msg.num_tokens, what)
        if error:
            return error
        if not 0 <= msg.layer < cache.shape[0] or not 0 <= msg.start < msg.end <= msg.num_tokens:
            return f"{what}: layer {msg.layer} positions [{msg.start}, {msg.end}) of {msg.num_tokens}"
        if msg.dtype != self.dtype_name or len(frames) != 1:
            return f"{what}: {len(frames)} frames of {msg.dtype}, expected 1 of {self.dtype_name}"
        token_bytes = 2 * cache.element_size() * cache[0, 0, 0, 0].numel()
        if len(frames[0].buffer) != token_bytes * (msg.end - msg.start):
            return f"truncated KV layer {msg.layer} for {pull.req_id}"
        if (msg.checksum is not None and self.verify_checksums
                and frames_checksum([frames[0].buffer]) != msg.checksum):
            self.stats.checksum_mismatches += 1
            return f"corrupted KV layer {msg.layer} for {pull.req_id} from {pull.endpoint}: checksum mismatch"
        return None

    def _write_layer(self, pull: Pull, msg: m.KVLayer, buffer: memoryview) -> None:
        cache = self.kv_cache
        block_size, heads, dim = cache.shape[3:]
        pos = torch.arange(msg.start, msg.end)
        blocks = torch.tensor(pull.block_ids[: -(-msg.end // block_size)], dtype=torch.long)
        slots = (blocks[pos // block_size] * block_size + pos % block_size).to(cache.device)
        data = torch.frombuffer(buffer, dtype=torch.uint8).view(cache.dtype).view(2, -1, heads, dim)
        cache[msg.layer].view(2, -1, heads, dim).index_copy_(1, slots, data.to(cache.device))
        self.stats.bytes_received += len(buffer)

    def _on_error(self, peer: Peer, msg: m.KVError, failed: list[Failed]) -> None:
        pull = self._expected(peer, msg.req_id, msg.transfer_id)
        if pull is None:
            self.stats.dropped_unexpected += 1
            return
        self._end(pull)
        self.stats.transfers_failed += 1
        failed.append(Failed(msg.req_id, f"prefill refused the KV transfer: {msg.reason}", msg.retryable))

    def _validate(self, pull: Pull, header: m.KVHeader, frames: list) -> str | None:
        """Why the header and frames do not fit the reservation, or None. Runs before any write."""
        cache, everything = self.kv_cache, frames
        block_shape = list(cache.shape[3:])
        runs, n = header.run_lengths, header.num_blocks
        what = f"malformed KV transfer for {pull.req_id} from {pull.endpoint}"
        if header.block_shape != block_shape or header.dtype != self.dtype_name:
            return f"{what}: blocks {header.block_shape} {header.dtype}, expected {block_shape} {self.dtype_name}"
        if pull.num_tokens is not None and header.num_tokens != pull.num_tokens:
            return f"{what}: {header.num_tokens} tokens, the reserved prompt has {pull.num_tokens}"
        if header.num_tokens < 1 or n != -(-header.num_tokens // block_shape[0]) or n > len(pull.block_ids):
            return (f"{what}: {n} blocks for {header.num_tokens} tokens of {block_shape[0]} per block "
                    f"({len(pull.block_ids)} reserved)")
        if self.vocab_size is not None and not 0 <= header.t0 < self.vocab_size:
            return f"{what}: t0={header.t0} is outside the vocabulary [0, {self.vocab_size})"
        if min(runs, default=0) < 1 or sum(runs) != n:
            return f"{what}: runs {runs[:8]} do not cover its {n} blocks"
        num_layers, hidden = self._num_layers(header.hidden_positions), bool(header.hidden_positions)
        if len(frames) != num_layers * 2 * len(runs) + hidden:
            return (f"{what}: {len(frames)} frames, expected {num_layers} layers x K/V x {len(runs)} runs of "
                    f"{block_shape} {self.dtype_name}" + (" and the hidden states" if hidden else ""))
        if hidden:
            error = self._hidden_error(header.hidden_positions, header.num_tokens, header.hidden_dtype, frames[-1],
                                       what)
            if error:
                return error
            frames = frames[:-1]
        block_bytes = cache.element_size() * cache[0, 0, 0].numel()
        if any(len(frames[i].buffer) != block_bytes * runs[i % len(runs)] for i in range(len(frames))):
            return f"truncated KV transfer for {pull.req_id}"
        if (header.checksum is not None and self.verify_checksums
                and frames_checksum([f.buffer for f in everything]) != header.checksum):
            self.stats.checksum_mismatches += 1
            return f"corrupted KV transfer for {pull.req_id} from {pull.endpoint}: checksum mismatch"
        return None

    def _write(self, pull: Pull, header: m.KVHeader, frames: list) -> None:
        """Copy validated KV frames into the reserved blocks."""
        cache = self.kv_cache
        runs, block_shape = header.run_lengths, list(cache.shape[3:])
        dst = torch.tensor(pull.block_ids[: header.num_blocks], dtype=torch.long, device=cache.device)
        offsets = [0]
        for n in runs:
            offsets.append(offsets[-1] + n)
        i = 0
        for layer in range(self._num_layers(header.hidden_positions)):
            for kv in (0, 1):
                for r, n in enumerate(runs):
                    data = torch.frombuffer(frames[i].buffer, dtype=torch.uint8).view(cache.dtype).view(n, *block_shape)
                    cache[layer, kv].index_copy_(0, dst[offsets[r] : offsets[r + 1]], data.to(cache.device))
                    i += 1
        self.stats.bytes_received += sum(len(f.buffer) for f in frames)

    def _housekeeping(self, failed: list[Failed]) -> None:
        now = self.clock()
        for endpoint, peer in self.peers.items():
            if peer.state == "rejected":
                for req_id in list(peer.pulls):
                    pull = self.pulls.get(req_id)
                    if pull is not None:
                        self._end(pull)
                        self.stats.transfers_failed += 1
                        failed.append(Failed(req_id, f"prefill {endpoint} refused the handshake: {peer.reason}"))
                peer.pulls.clear()
            elif peer.pulls and now - peer.last_keepalive > KEEPALIVE_S and peer.state == "ready":
                req_ids = sorted(peer.pulls)
                tids = [self.pulls[r].transfer_id if r in self.pulls else "" for r in req_ids]
                self._send(peer, m.KeepAlive(req_ids, tids))
                peer.last_keepalive = now
            elif peer.pulls and now - peer.last_keepalive > KEEPALIVE_S and peer.state == "connecting":
                # No HelloAck yet: the Hello may have reached a process that died before answering,
                # and its successor at the same address would never hear from us. Say it again.
                self._hello(peer)
                peer.last_keepalive = now
        self._watch_progress(now, failed)

    def _watch_progress(self, now: float, failed: list[Failed]) -> None:
        """Resume pulls that went quiet; give up those without progress for `deadline_s`."""
        for pull in list(self.pulls.values()):
            peer = self.peers[pull.endpoint]
            quiet = now - max(pull.progress_at, peer.progress_at)
            if quiet > self.deadline_s:
                self.cancel(pull.req_id, "no progress")
                self.stats.transfers_failed += 1
                self.stats.transfers_stalled += 1
                reason = (f"KV transfer from {pull.endpoint} timed out: no progress for {self.deadline_s:g} s "
                          "(--kv-deadline-s)")
                logger.warning("%s: %s", pull.req_id, reason)
                failed.append(Failed(pull.req_id, reason))
            elif (quiet > RESUME_AFTER_S and peer.state == "ready" and peer.connected and pull.requested
                  and now - pull.last_request > RESUME_AFTER_S):  # (while disconnected, the reconnect resumes it)
                logger.info("KV transfer of %s from %s quiet for %.1f s: asking for the rest again", pull.req_id,
                            pull.endpoint, quiet)
                self._request(peer, pull)

    def _send(self, peer: Peer, msg: m.Message) -> None:
        try:
            peer.socket.send(m.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # queue full or peer gone; the deadline handles it

    def close(self) -> None:
        for peer in self.peers.values():
            if peer.monitor is not None:
                peer.socket.disable_monitor()
                peer.monitor.close(0)
            peer.socket.close(0)


def cover(spans: list[list[int]], start: int, end: int) -> None:
    """Add [start, end) to sorted, merged, disjoint `spans` in place (repeats and overlaps are fine)."""
    spans.append([start, end])
    spans.sort()
    merged = [spans[0]]
    for s, e in spans[1:]:
        if s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    spans[:] = merged
