"""Decode side (D): pull KV blocks from prefill instances into reserved blocks.

One DEALER per prefill endpoint, handshaked on first use. Every pull has a deadline; a pull
that misses it (P died, P overloaded) fails with a clear reason and P is told to release.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from kv_transfer import messages as m
from kv_transfer.stats import TransferStats

logger = logging.getLogger(__name__)

KEEPALIVE_S = 1.0


@dataclass
class Pull:
    req_id: str
    endpoint: str
    block_ids: list[int]
    started: float
    deadline: float
    requested: bool = False


@dataclass
class Completed:
    req_id: str
    t0: int
    num_tokens: int


@dataclass
class Failed:
    req_id: str
    reason: str


@dataclass
class Peer:
    socket: zmq.Socket
    state: str = "connecting"   # connecting -> ready | rejected
    reason: str = ""
    pulls: set[str] = field(default_factory=set)
    last_keepalive: float = 0.0


class KVReceiver:
    def __init__(self, ctx: zmq.Context, kv_cache: torch.Tensor, compat_hash: str, description: str, name: str,
                 deadline_s: float = 60.0, key: str = "") -> None:
        self.ctx = ctx
        self.kv_cache = kv_cache
        self.compat_hash, self.description, self.name = compat_hash, description, name
        self.deadline_s = deadline_s
        self.key = key
        self.peers: dict[str, Peer] = {}
        self.pulls: dict[str, Pull] = {}
        self.stats = TransferStats()
        self.dtype_name = str(kv_cache.dtype).removeprefix("torch.")

    def start(self, req_id: str, endpoint: str, block_ids: list[int]) -> None:
        now = time.monotonic()
        pull = Pull(req_id, endpoint, block_ids, now, now + self.deadline_s)
        self.pulls[req_id] = pull
        peer = self._peer(endpoint)
        peer.pulls.add(req_id)
        if peer.state == "ready":
            self._request(peer, pull)

    def cancel(self, req_id: str, reason: str) -> None:
        pull = self.pulls.pop(req_id, None)
        if pull is not None:
            peer = self.peers.get(pull.endpoint)
            if peer is not None:
                peer.pulls.discard(req_id)
                self._send(peer, m.Release(req_id, reason))

    def sockets(self) -> list[zmq.Socket]:
        return [p.socket for p in self.peers.values()]

    def poll(self) -> tuple[list[Completed], list[Failed]]:
        done: list[Completed] = []
        failed: list[Failed] = []
        for endpoint, peer in list(self.peers.items()):
            while True:
                try:
                    frames = peer.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle(endpoint, peer, frames, done, failed)
        self._housekeeping(failed)
        return done, failed

    # -- protocol ------------------------------------------------------------------------

    def _peer(self, endpoint: str) -> Peer:
        peer = self.peers.get(endpoint)
        if peer is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            peer = Peer(sock, last_keepalive=time.monotonic())  # the Hello below counts as the first "keepalive"
            self.peers[endpoint] = peer
            self._send(peer, m.Hello(self.compat_hash, self.description, self.name, self.key))
        return peer

    def _rehandshake(self, peer: Peer) -> None:
        """Say Hello again; pulls not yet answered are re-sent once the HelloAck arrives."""
        peer.state = "connecting"
        peer.last_keepalive = time.monotonic()
        for req_id in peer.pulls:
            if req_id in self.pulls:
                self.pulls[req_id].requested = False
        self._send(peer, m.Hello(self.compat_hash, self.description, self.name, self.key))

    def _request(self, peer: Peer, pull: Pull) -> None:
        self._send(peer, m.PullKV(pull.req_id))
        pull.requested = True

    def _handle(self, endpoint: str, peer: Peer, frames: list, done: list[Completed], failed: list[Failed]) -> None:
        try:
            msg = m.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.stats.dropped_frames += 1
            return
        if isinstance(msg, m.HelloAck):
            peer.state = "ready"
            for req_id in list(peer.pulls):
                if req_id in self.pulls and not self.pulls[req_id].requested:
                    self._request(peer, self.pulls[req_id])
        elif isinstance(msg, m.HandshakeRequired):
            if peer.state == "ready":  # every message sent meanwhile bounces: re-handshake once
                logger.warning("prefill %s lost our handshake (restarted?): saying Hello again", endpoint)
                self._rehandshake(peer)
        elif isinstance(msg, m.HelloReject):
            peer.state, peer.reason = "rejected", msg.reason
            self.stats.handshakes_rejected += 1
            logger.error("prefill %s refused the handshake: %s", endpoint, msg.reason)
        elif isinstance(msg, m.KVHeader):
            pull = self.pulls.pop(msg.req_id, None)
            if pull is None:
                return  # cancelled meanwhile; P's lease was already released by our Release
            peer.pulls.discard(msg.req_id)
            error = self._write(pull, msg, frames[1:])
            if error:
                self.stats.transfers_failed += 1
                self._send(peer, m.Release(msg.req_id, error))
                failed.append(Failed(msg.req_id, error))
                return
            self._send(peer, m.KVAck(msg.req_id))
            self.stats.transfers_received += 1
            self.stats.latency_seconds_sum += time.monotonic() - pull.started
            self.stats.latency_seconds_count += 1
            done.append(Completed(msg.req_id, msg.t0, msg.num_tokens))
        elif isinstance(msg, m.KVError):
            pull = self.pulls.pop(msg.req_id, None)
            peer.pulls.discard(msg.req_id)
            if pull is not None:
                self.stats.transfers_failed += 1
                failed.append(Failed(msg.req_id, f"prefill refused the KV transfer: {msg.reason}"))
        else:
            self.stats.dropped_frames += 1

    def _write(self, pull: Pull, header: m.KVHeader, frames: list) -> str | None:
        cache = self.kv_cache
        num_layers = cache.shape[0]
        runs = header.run_lengths
        block_shape = list(cache.shape[3:])
        if (header.block_shape != block_shape or header.dtype != self.dtype_name or sum(runs) != header.num_blocks
                or header.num_blocks > len(pull.block_ids) or len(frames) != num_layers * 2 * len(runs)
                or min(runs, default=1) < 1):
            return (f"malformed KV transfer for {pull.req_id}: {len(frames)} frames of blocks {header.block_shape} "
                    f"{header.dtype}, expected {num_layers} layers x K/V x {len(runs)} runs of "
                    f"{block_shape} {self.dtype_name}")
        block_bytes = cache.element_size() * cache[0, 0, 0].numel()
        if any(len(frames[i].buffer) != block_bytes * runs[i % len(runs)] for i in range(len(frames))):
            return f"truncated KV transfer for {pull.req_id}"
        dst = torch.tensor(pull.block_ids[: header.num_blocks], dtype=torch.long, device=cache.device)
        offsets = [0]
        for n in runs:
            offsets.append(offsets[-1] + n)
        i = 0
        for layer in range(num_layers):
            for kv in (0, 1):
                for r, n in enumerate(runs):
                    data = torch.frombuffer(frames[i].buffer, dtype=torch.uint8).view(cache.dtype).view(n, *block_shape)
                    cache[layer, kv].index_copy_(0, dst[offsets[r] : offsets[r + 1]], data.to(cache.device))
                    i += 1
        self.stats.bytes_received += block_bytes * header.num_blocks * 2 * num_layers
        return None

    def _housekeeping(self, failed: list[Failed]) -> None:
        now = time.monotonic()
        for endpoint, peer in self.peers.items():
            if peer.state == "rejected":
                for req_id in list(peer.pulls):
                    if self.pulls.pop(req_id, None) is not None:
                        self.stats.transfers_failed += 1
                        failed.append(Failed(req_id, f"prefill {endpoint} refused the handshake: {peer.reason}"))
                peer.pulls.clear()
            elif peer.pulls and now - peer.last_keepalive > KEEPALIVE_S and peer.state == "ready":
                self._send(peer, m.KeepAlive(sorted(peer.pulls)))
                peer.last_keepalive = now
            elif peer.pulls and now - peer.last_keepalive > KEEPALIVE_S and peer.state == "connecting":
                # No HelloAck yet: the Hello may have reached a process that died before answering,
                # and its successor at the same address would never hear from us. Say it again.
                self._send(peer, m.Hello(self.compat_hash, self.description, self.name, self.key))
                peer.last_keepalive = now
        for req_id in [r for r, p in self.pulls.items() if p.deadline < now]:
            pull = self.pulls[req_id]
            self.cancel(req_id, "reservation deadline passed")
            self.stats.transfers_failed += 1
            failed.append(Failed(req_id, f"KV transfer from {pull.endpoint} timed out after {self.deadline_s:.0f} s"))

    def _send(self, peer: Peer, msg: m.Message) -> None:
        try:
            peer.socket.send(m.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # queue full or peer gone; the deadline handles it

    def close(self) -> None:
        for peer in self.peers.values():
            peer.socket.close(0)
