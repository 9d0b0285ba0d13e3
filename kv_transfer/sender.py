"""Prefill side (P): serve KV blocks to decode instances over a ROUTER socket.

A finished prefill's blocks are *held* under a lease (this is the only record of them: the
scheduler has forgotten the request). D's KeepAlive renews it, D's KVAck or
Release frees the blocks, and an expired lease frees them too, so a dead D never leaks memory.
"""
from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from kv_transfer import messages as m
from kv_transfer.stats import TransferStats

logger = logging.getLogger(__name__)


@dataclass
class HeldKV:
    req_id: str
    block_ids: list[int]
    num_tokens: int
    t0: int
    deadline: float
    requester: bytes | None = None   # D's identity once it asked
    sent: bool = False


@dataclass
class PendingPull:
    requester: bytes
    deadline: float


def consecutive_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """[(first block, count)] for each run of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


class KVSender:
    def __init__(self, ctx: zmq.Context, bind_addr: str, kv_cache: torch.Tensor, compat_hash: str,
                 description: str, name: str, release_blocks: Callable[[str, list[int]], None], lease_s: float = 30.0,
                 key: str = "") -> None:
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.socket.bind(bind_addr)
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.kv_cache = kv_cache
        self.compat_hash, self.description, self.name = compat_hash, description, name
        self.release_blocks = release_blocks
        self.lease_s = lease_s
        self.key = key
        self.peers: set[bytes] = set()   # authenticated D identities
        self.held: dict[str, HeldKV] = {}
        self.pulls: dict[str, PendingPull] = {}  # pulls that arrived before the prefill finished
        self.stats = TransferStats()

    # -- engine-facing -------------------------------------------------------------------

    def hold(self, req_id: str, block_ids: list[int], num_tokens: int, t0: int) -> None:
        """A prefill finished: keep its blocks until D takes them (or the lease runs out)."""
        held = HeldKV(req_id, block_ids, num_tokens, t0, time.monotonic() + self.lease_s)
        self.held[req_id] = held
        pull = self.pulls.pop(req_id, None)
        if pull is not None:
            held.requester = pull.requester
            self._send(held)

    def drop(self, req_id: str, reason: str) -> None:
        """Abort from the server: tell D (if it asked) and free."""
        held = self.held.pop(req_id, None)
        pull = self.pulls.pop(req_id, None)
        requester = held.requester if held else (pull.requester if pull else None)
        if requester is not None:
            self._send_msg(requester, m.KVError(req_id, reason))
        if held is not None:
            self.release_blocks(req_id, held.block_ids)

    def poll(self) -> None:
        """Handle every message waiting on the KV port, then expire leases."""
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._handle(frames)
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
        now = time.monotonic()
        if isinstance(msg, m.PullKV):
            held = self.held.get(msg.req_id)
            if held is None:
                self.pulls[msg.req_id] = PendingPull(identity, now + self.lease_s)
            else:
                # A pull from a new connection (D re-handshaked after a reconnect): the first copy went
                # to a connection that no longer exists, so send again. D ignores a duplicate.
                resend = held.sent and held.requester != identity
                held.requester = identity
                held.deadline = now + self.lease_s
                if not held.sent or resend:
                    self._send(held)
        elif isinstance(msg, m.KVAck):
            self._release(msg.req_id)
        elif isinstance(msg, m.Release):
            self.pulls.pop(msg.req_id, None)
            self._release(msg.req_id)
        elif isinstance(msg, m.KeepAlive):
            for req_id in msg.req_ids:
                if req_id in self.held:
                    self.held[req_id].deadline = now + self.lease_s
                elif req_id in self.pulls:
                    self.pulls[req_id].deadline = now + self.lease_s
        else:
            self.stats.dropped_frames += 1

    def _handshake(self, identity: bytes, hello: m.Hello) -> None:
        if self.key and not hmac.compare_digest(hello.key.encode(), self.key.encode()):
            self.stats.handshakes_rejected += 1
            self._send_msg(identity, m.HelloReject("KV port key mismatch: set the same --kv-key on prefill and decode"))
            return
        if hello.compat_hash != self.compat_hash:
            self.stats.handshakes_rejected += 1
            reason = (f"incompatible KV layout: prefill {self.name} has {self.description}, "
                      f"decode {hello.peer} has {hello.description}")
            logger.error("refusing decode peer %s: %s", hello.peer, reason)
            self._send_msg(identity, m.HelloReject(reason))
            return
        self.peers.add(identity)
        self._send_msg(identity, m.HelloAck(self.name))

    def _send(self, held: HeldKV) -> None:
        assert held.requester is not None
        cache = self.kv_cache
        num_blocks = -(-held.num_tokens // cache.shape[3])
        runs = consecutive_runs(held.block_ids[:num_blocks])
        # Zero-copy: each run of consecutive blocks of one layer's K (or V) is one contiguous slice
        # of the cache. The blocks stay held until D acks, so the memory is stable while ZMQ sends.
        frames = []
        for layer in range(cache.shape[0]):
            for kv in (0, 1):
                for start, n in runs:
                    part = cache[layer, kv, start : start + n]
                    if part.device.type != "cpu":
                        part = part.cpu()
                    frames.append(memoryview(part.view(torch.uint8).numpy()).cast("B"))
        header = m.KVHeader(held.req_id, held.num_tokens, num_blocks, held.t0, [n for _, n in runs],
                            list(cache.shape[3:]), str(cache.dtype).removeprefix("torch."))
        self.socket.send_multipart([held.requester, m.encode(header), *frames], copy=False)
        held.sent = True
        self.stats.transfers_sent += 1
        self.stats.bytes_sent += sum(f.nbytes for f in frames)

    def _release(self, req_id: str) -> None:
        held = self.held.pop(req_id, None)
        if held is not None:
            self.release_blocks(req_id, held.block_ids)

    def _send_msg(self, identity: bytes, msg: m.Message) -> None:
        try:
            self.socket.send_multipart([identity, m.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer is gone; its lease will expire

    def _expire(self) -> None:
        now = time.monotonic()
        for req_id in [r for r, h in self.held.items() if h.deadline < now]:
            held = self.held.pop(req_id)
            self.stats.leases_expired += 1
            logger.warning("KV lease of %s expired (decode peer silent): freeing %d blocks", req_id,
                           len(held.block_ids))
            self.release_blocks(req_id, held.block_ids)
        for req_id in [r for r, p in self.pulls.items() if p.deadline < now]:
            del self.pulls[req_id]

    def close(self) -> None:
        self.socket.close(0)
