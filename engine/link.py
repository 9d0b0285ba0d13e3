"""An engine's link to the front end, run by a thread of its own.

The engine loop never touches the network socket. It hands its outputs to this thread over an
in-process pipe that never blocks, and reads the front end's messages from the same pipe (the
loop polls it together with its KV sockets). The thread owns the DEALER to the front end and:

- sends the heartbeat every HEARTBEAT_S whatever the loop is doing, so a step of any length is
  never mistaken for a death (the heartbeat says how long the step has been running);
- sends outputs without ever blocking: what the front end cannot take now (it is gone, or slow)
  waits in a bounded buffer, oldest dropped first, and goes out once it reconnects;
- watches the handshake: an engine whose link never comes up (no cluster key, a wrong key, a wrong
  address) logs the cause within seconds and, after `give_up_s`, reports itself `failed` so the
  engine exits non-zero instead of idling unseen. A link that was up and went down (the front end
  restarted) is waited for without limit: the engine re-registers with the next front end.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from engine import messages as msg
from engine.cluster_key import ClusterKey
from engine.sockets import harden

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.2
MAX_BUFFERED = 100_000   # outputs held while the front end cannot take them (then the oldest go)
WARN_EVERY_S = 10.0      # a link problem is logged at most this often

_HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed",
                     zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "a security mismatch (one side has a cluster key, "
                                                          "the other none)",
                     zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the front end refused our cluster key (a different key)"}
_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class FrontEndLink:
    def __init__(self, ctx: zmq.Context, server_addr: str, name: str, cluster_key: ClusterKey | None,
                 heartbeat: Callable[[], msg.Heartbeat], give_up_s: float = 60.0) -> None:
        self.server_addr, self.name, self.heartbeat, self.give_up_s = server_addr, name, heartbeat, give_up_s
        self.has_key = cluster_key is not None
        self.upstream = harden(ctx.socket(zmq.DEALER))
        self.upstream.setsockopt(zmq.IDENTITY, name.encode())
        self.upstream.setsockopt(zmq.LINGER, 0)
        if cluster_key is not None:
            cluster_key.secure_client(self.upstream)
        self.monitor = self.upstream.get_monitor_socket(_EVENTS)
        self.upstream.connect(server_addr)
        pipe = f"inproc://link-{uuid.uuid4().hex}"
        self.pipe, self._pipe_far = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        for sock in (self.pipe, self._pipe_far):
            sock.setsockopt(zmq.SNDHWM, 0)  # in-process: never blocks; the bound is `buffered` below
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
        self.pipe.bind(pipe)
        self._pipe_far.connect(pipe)
        self.buffered: deque[bytes] = deque()
        self.dropped = 0                # outputs dropped because the buffer was full
        self.connected = False          # a handshake with the front end completed and holds
        self.ever_connected = False
        self.failed: str | None = None  # why the engine should give up (set once, read by the loop)
        self.refused = False            # the last handshake attempt failed (key or security mismatch)
        self._since = time.monotonic()  # start of the current spell without a link
        self._flush_by = 0.0
        self._last_warning = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-link", daemon=True)
        self._thread.start()

    # -- the engine loop's side ------------------------------------------------------------

    def send(self, message: msg.Output | msg.Leaving) -> None:
        self.pipe.send(msg.encode(message), zmq.NOBLOCK)

    def recv(self) -> bytes | None:
        try:
            return self.pipe.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def close(self, flush_s: float = 1.0) -> None:
        """Send what is buffered (for up to `flush_s`), then stop the thread and close."""
        self._flush_by = time.monotonic() + flush_s
        self._stop.set()
        self._thread.join(flush_s + 2.0)
        self.pipe.close(0)

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.upstream, self._pipe_far, self.monitor):
            poller.register(sock, zmq.POLLIN)
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    self._beat()
                    next_beat = now + HEARTBEAT_S
                self._watch_handshake(now)
                flags = zmq.POLLIN | (zmq.POLLOUT if self.buffered else 0)
                poller.register(self.upstream, flags)
                events = dict(poller.poll(max(1, int((next_beat - time.monotonic()) * 1000))))
                if self.monitor in events:
                    self._on_monitor_events()
                if self.upstream in events:
                    self._relay_in()
                if self._pipe_far in events:
                    self._take_outputs()
                self._flush()
            self._drain_before_close()
        finally:
            self.upstream.disable_monitor()
            for sock in (self.monitor, self.upstream, self._pipe_far):
                sock.close(0)

    def _beat(self) -> None:
        try:
            self.upstream.send(msg.encode(self.heartbeat()), zmq.NOBLOCK)
        except zmq.Again:
            pass  # no front end to take it: heartbeats are not worth keeping

    def _relay_in(self) -> None:
        while True:
            try:
                self._pipe_far.send(self.upstream.recv(zmq.NOBLOCK), zmq.NOBLOCK)
            except zmq.Again:
                return

    def _take_outputs(self) -> None:
        while True:
            try:
                self.buffered.append(self._pipe_far.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        while len(self.buffered) > MAX_BUFFERED:
            self.buffered.popleft()
            self.dropped += 1

    def _flush(self) -> None:
        while self.buffered:
            try:
                self.upstream.send(self.buffered[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self.buffered.popleft()

    def _drain_before_close(self) -> None:
        self._take_outputs()
        while self.buffered and time.monotonic() < self._flush_by:
            self._flush()
            if self.buffered:
                time.sleep(0.01)

    # -- the handshake ---------------------------------------------------------------------

    def _on_monitor_events(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if not self.connected:
                    logger.info("%s: linked to the front end at %s", self.name, self.server_addr)
                self.connected = self.ever_connected = True
                self.refused = False
            elif kind == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected, self._since = False, time.monotonic()
                logger.warning("%s: lost the front end at %s; still stepping, reconnecting", self.name,
                               self.server_addr)
            elif kind in _HANDSHAKE_FAILED:
                self._warn(f"cannot register with the front end at {self.server_addr}: {_HANDSHAKE_FAILED[kind]}; "
                           f"this engine {'has a' if self.has_key else 'has no'} cluster key "
                           "(PDSERVE_CLUSTER_KEY_FILE)")
                if self.connected:
                    self._since = time.monotonic()
                self.connected, self.refused = False, True

    def _watch_handshake(self, now: float) -> None:
        if self.connected or self.failed:
            return
        waited = now - self._since
        if not (self.refused or not self.ever_connected):
            return  # the front end went away after we were registered: wait for the next one
        if waited > min(5.0, self.give_up_s):
            self._warn(f"no handshake with the front end at {self.server_addr} after {waited:.0f} s "
                       "(is the address right, is it up, do both sides have the same cluster key?)")
        if waited > self.give_up_s:
            self.failed = (f"could not register with the front end at {self.server_addr} within "
                           f"{self.give_up_s:g} s (--register-timeout-s)"
                           + (": the handshake was refused (cluster key)" if self.refused else ""))

    def _warn(self, text: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= WARN_EVERY_S:
            self._last_warning = now
            logger.error("%s: %s", self.name, text)
