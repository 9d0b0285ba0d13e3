"""Layer-wise KV push on a prefill instance (P): the thread that owns P's KV port.

In layer-wise mode the compute thread must never wait on the network, yet each layer's KV should
leave as soon as the forward wrote it, while the rest of the prefill runs. A ZMQ socket belongs
to one thread, so this thread owns P's ROUTER and

  - relays every message between the ROUTER and the engine thread's end of an inproc PAIR,
    unchanged: KVSender's protocol logic (handshake, leases, pulls, acks) stays on the engine
    thread and sees the same [identity, payload, ...] frames as without this thread;
  - learns where a transfer goes from D's PullKV as it passes by, so it need not wait for the
    engine thread's next turn (which comes only after the step that is computing the layers).
    It trusts a PullKV only from a peer the engine thread accepted: the engine thread announces
    each with a local PeerReady before its HelloAck;
  - sends the layer snapshots the compute thread queued, then the transfer's KVLayersDone, in
    the order they were queued; snapshots wait here until D's pull names their route.

Local control from the engine thread travels on the PAIR behind an empty identity frame (a
ROUTER identity is never empty). Snapshots are copies, so they stay valid whatever happens to
the blocks they came from; a transfer that ended (Forget) drops what is still waiting. A snapshot
larger than sender.MAX_FRAME_BYTES goes out as several KVLayer messages (sender.py says why).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
import torch
import xxhash
import zmq

from kv_transfer import messages as m

logger = logging.getLogger(__name__)

Key = tuple[str, str]   # (req_id, transfer_id)
FORGOTTEN_MEMORY = 4096  # ended transfers whose late snapshots are dropped
LOCAL = b""              # identity frame of a local control message on the PAIR
_ids = itertools.count()


class PeerReady(msgspec.Struct, tag=True):
    identity: bytes


class Forget(msgspec.Struct, tag=True):
    req_id: str
    transfer_id: str


class Wake(msgspec.Struct, tag=True):
    """Jobs are queued."""


Local = PeerReady | Forget | Wake
_local_decoder = msgspec.msgpack.Decoder(Local)


@dataclass
class LayerJob:
    key: Key
    layer: int
    start: int
    end: int
    num_tokens: int
    kv: torch.Tensor                      # [2, end - start, kv_heads, head_dim] on the host
    ready: torch.cuda.Event | None = None  # set when a device-to-host copy is still running


@dataclass
class DoneJob:
    key: Key
    message: m.KVLayersDone
    frames: list = field(default_factory=list)  # what follows the message (the hidden states, if handed over)


class LayerStreamer:
    def __init__(self, ctx: zmq.Context, router: zmq.Socket, name: str, checksum: bool,
                 max_frame_bytes: int = 1 << 62) -> None:
        """Takes over `router` (bound, configured): the engine thread must not touch it again and
        uses `engine_socket` instead. Snapshots go out in frames of at most `max_frame_bytes`."""
        self.router, self.name, self.checksum = router, name, checksum
        self.max_frame_bytes = max_frame_bytes
        address = f"inproc://kv-stream-{name}-{next(_ids)}"
        self.engine_socket = ctx.socket(zmq.PAIR)   # the engine thread's end
        self.engine_socket.setsockopt(zmq.LINGER, 0)
        self.engine_socket.setsockopt(zmq.SNDHWM, 0)  # a resend's pieces pass here: never block the engine on them
        self.engine_socket.bind(address)
        self._pair = ctx.socket(zmq.PAIR)           # this thread's end
        self._pair.setsockopt(zmq.LINGER, 0)
        self._pair.setsockopt(zmq.RCVHWM, 0)
        self._pair.connect(address)
        self.jobs: queue.SimpleQueue[LayerJob | DoneJob] = queue.SimpleQueue()
        self.peers: set[bytes] = set()
        self.routes: dict[Key, bytes] = {}
        self.waiting: dict[Key, list[LayerJob | DoneJob]] = {}
        self.forgotten: OrderedDict[Key, None] = OrderedDict()
        # Written by this thread only; the engine thread reads them for its counters.
        self.layers_sent = 0
        self.bytes_sent = 0
        self.send_errors = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"kv-stream-{name}", daemon=True)
        self._thread.start()

    # -- engine thread -------------------------------------------------------------------

    def submit(self, job: LayerJob | DoneJob) -> None:
        """Queue a snapshot or a completion (never blocks on the network)."""
        self.jobs.put(job)
        self._local(Wake())

    def peer_ready(self, identity: bytes) -> None:
        self._local(PeerReady(identity))

    def forget(self, key: Key) -> None:
        self._local(Forget(*key))

    def _local(self, msg: Local) -> None:
        self.engine_socket.send_multipart([LOCAL, m.encode(msg)])  # type: ignore[arg-type]

    def close(self) -> None:
        self._stopping = True
        self._thread.join(timeout=5)
        self.engine_socket.close(0)

    # -- this thread ---------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._pair, zmq.POLLIN)
        try:
            while not self._stopping:
                events = dict(poller.poll(50))
                if self.router in events:
                    self._from_peers()
                if self._pair in events:
                    self._from_engine()
                self._drain_jobs()
        except Exception:  # a bug here must not leave P silently deaf: say so loudly
            logger.exception("KV stream thread of %s failed", self.name)
            raise
        finally:
            self.router.close(0)
            self._pair.close(0)

    def _from_peers(self) -> None:
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) == 2 and frames[0].bytes in self.peers:
                self._maybe_route(frames[0].bytes, frames[1].buffer)
            self._pair.send_multipart(frames, copy=False)  # the engine thread judges every message

    def _maybe_route(self, identity: bytes, payload: memoryview) -> None:
        try:
            msg = m.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if not isinstance(msg, m.PullKV):
            return
        key = (msg.req_id, msg.transfer_id)
        # The first pull names the route; a pull from another connection later (D re-handshaked)
        # is the engine thread's to answer, with a whole-transfer resend.
        if key in self.routes or key in self.forgotten:
            return
        self.routes[key] = identity
        for job in self.waiting.pop(key, []):
            self._send(identity, job)

    def _from_engine(self) -> None:
        while True:
            try:
                frames = self._pair.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if frames[0].bytes != LOCAL:
                self._send_frames(frames)
                continue
            msg = _local_decoder.decode(frames[1].buffer)
            if isinstance(msg, PeerReady):
                self.peers.add(msg.identity)
            elif isinstance(msg, Forget):
                self._forget((msg.req_id, msg.transfer_id))

    def _drain_jobs(self) -> None:
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job.key in self.forgotten:
                continue
            identity = self.routes.get(job.key)
            if identity is None:
                self.waiting.setdefault(job.key, []).append(job)
            else:
                self._send(identity, job)

    def _send(self, identity: bytes, job: LayerJob | DoneJob) -> None:
        if isinstance(job, DoneJob):
            self._send_frames([identity, m.encode(job.message), *job.frames])
            self._forget(job.key)  # nothing of it comes after the completion
            return
        if job.ready is not None:
            job.ready.synchronize()  # the device-to-host copy (off the compute stream)
        req_id, transfer_id = job.key
        token_bytes = job.kv[:, :1].numel() * job.kv.element_size()
        step = max(1, self.max_frame_bytes // token_bytes)
        for a in range(0, job.end - job.start, step):
            b = min(a + step, job.end - job.start)
            part = job.kv if (a, b) == (0, job.end - job.start) else job.kv[:, a:b].contiguous()
            frame = memoryview(part.view(torch.uint8).numpy()).cast("B")
            header = m.KVLayer(req_id, transfer_id, self.name, job.layer, job.start + a, job.start + b,
                               job.num_tokens, str(job.kv.dtype).removeprefix("torch."),
                               xxhash.xxh3_64_intdigest(frame) if self.checksum else None, time.time())
            self._send_frames([identity, m.encode(header), frame])
            self.bytes_sent += frame.nbytes
            self.layers_sent += 1  # KVLayer messages, as D counts them (layers_received)

    def _send_frames(self, frames: list) -> None:
        try:
            self.router.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            self.send_errors += 1  # the peer is gone: its lease (or D's deadline) ends the transfer

    def _forget(self, key: Key) -> None:
        self.routes.pop(key, None)
        self.waiting.pop(key, None)
        self.forgotten[key] = None
        while len(self.forgotten) > FORGOTTEN_MEMORY:
            self.forgotten.popitem(last=False)
