"""The front end's engine socket and the engines' liveness, run by a thread of its own.

Liveness is judged here, off the HTTP event loop: a front end busy with thousands of streams (or
stopped for a while) reads heartbeats late, and must not count its own lag against healthy
engines. The thread timestamps every heartbeat the moment it reads it, and when it notices it did
not run for a while itself (a pause, a starved process) it restarts every engine's silence count
instead of declaring them dead. An engine's state:

- STARTING: its loop has not turned yet (it is loading or warming up): no work is routed to it;
- READY: heart-beating, between steps or inside one of a normal length;
- STALLED: inside a step far longer than its own recent ones (its heartbeat says so): reported
  on /status, /metrics and in the log, and not routed to; after `stall_dead_after_s` it counts
  as dead;
- DEAD: no heartbeat for `dead_after_s` (the process is gone, or its host is cut off); heartbeats
  that come back (a restart under the same name) make it READY again;
- LEFT: it said it is leaving (SIGTERM).

The event loop sends through `send()` (an in-process pipe to this thread, never blocking) and
gets the engines' outputs in batches, timestamped as they arrived, through `on_outputs`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from engine import messages as msg
from engine.cluster_key import ClusterKey, check_bind
from engine.sockets import harden
from engine.types import EngineRole

logger = logging.getLogger(__name__)

POLL_MS = 50
PAUSED_S = 1.0       # a gap this long between two turns of this thread: we were paused, not the engines
WARN_EVERY_S = 10.0  # refused connections are logged at most this often per peer


class EngineState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    STALLED = "stalled"
    DEAD = "dead"
    LEFT = "left"


@dataclass
class Instance:
    name: str
    role: EngineRole
    heartbeat: msg.Heartbeat | None = None
    last_seen: float = 0.0
    state: EngineState = EngineState.STARTING
    since: float = 0.0               # when it entered `state`
    why: str = ""                    # what made it DEAD or LEFT
    outstanding: set[str] = field(default_factory=set)  # the event loop's: requests routed to it

    @property
    def routable(self) -> bool:
        return self.state == EngineState.READY


@dataclass
class Arrival:
    at: float                        # monotonic time the thread read it
    output: msg.Output


class EngineRouter:
    def __init__(self, bind_addr: str, cluster_key: ClusterKey | None, dead_after_s: float,
                 stall_dead_after_s: float, on_outputs: Callable[[list[Arrival]], None]) -> None:
        self.bind_addr, self.cluster_key = bind_addr, cluster_key
        self.dead_after_s, self.stall_dead_after_s = dead_after_s, stall_dead_after_s
        self.on_outputs = on_outputs
        self.table: dict[str, Instance] = {}  # the thread adds; the event loop reads and removes
        self.refused_connections = 0
        self.deaths = 0                       # READY/STALLED -> DEAD transitions
        self.stalls = 0                       # -> STALLED transitions
        self._warned: dict[str, float] = {}
        self._stop = threading.Event()

    # -- the event loop's side -----------------------------------------------------------

    def start(self) -> None:
        check_bind(self.bind_addr, self.cluster_key, "front end")
        self.loop = asyncio.get_running_loop()
        self.ctx = zmq.Context()
        self.router = harden(self.ctx.socket(zmq.ROUTER))
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted engine takes its name back
        self.router.setsockopt(zmq.SNDHWM, 100000)
        self.monitor = self._auth = None
        if self.cluster_key is not None:
            self.cluster_key.secure_server(self.router)
            self._auth = self.cluster_key.authenticator(self.ctx, on_refused=self._refused)
            self.monitor = self.router.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                                          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        else:
            logger.warning("no cluster key (PDSERVE_CLUSTER_KEY_FILE): the engine socket %s takes any process "
                           "that connects, so it may only listen on loopback or ipc", self.bind_addr)
        self.router.bind(self.bind_addr)
        self.address = self.router.getsockopt_string(zmq.LAST_ENDPOINT)  # with the port where bind_addr said 0
        pipe = f"inproc://router-{uuid.uuid4().hex}"
        self._out, self._out_far = self.ctx.socket(zmq.PAIR), self.ctx.socket(zmq.PAIR)
        for sock in (self._out, self._out_far):
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
        self._out.bind(pipe)
        self._out_far.connect(pipe)
        self._thread = threading.Thread(target=self._run, name="engine-router", daemon=True)
        self._thread.start()

    def send(self, name: str, message: msg.ToEngine) -> None:
        """From the event loop's thread only."""
        self._out.send_multipart([name.encode(), msg.encode(message)], zmq.NOBLOCK)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if self._auth is not None:
            self._auth.stop()
        self._out.close(0)
        self.ctx.destroy(linger=0)  # closes whatever a stuck thread left open, rather than wait on it

    def instances(self) -> list[Instance]:
        return list(self.table.values())  # one C-level copy: safe while the thread adds

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.router, self._out_far, self.monitor):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        last_turn = time.monotonic()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(POLL_MS))
                now = time.monotonic()
                if now - last_turn > PAUSED_S:
                    self._forgive(now, now - last_turn)
                last_turn = now
                if self.router in events:
                    self._read(now)
                if self._out_far in events:
                    self._forward()
                if self.monitor is not None and self.monitor in events:
                    self._read_monitor()
                # Judged as of the turn's start, whose gap since the last turn was just checked: a
                # pause inside this turn is seen (and forgiven) at the next turn's start, not taken
                # here for the engines' silence.
                self._judge(now)
        finally:
            if self.monitor is not None:
                self.router.disable_monitor()
                self.monitor.close(0)
            self.router.close(0)
            self._out_far.close(0)

    def _forgive(self, now: float, gap: float) -> None:
        logger.warning("the front end did not run for %.1f s (paused or starved): engine silences restart now, "
                       "none is judged on that gap", gap)
        for inst in self.instances():
            inst.last_seen = max(inst.last_seen, now)

    def _read(self, now: float) -> None:
        arrivals: list[Arrival] = []
        for _ in range(10000):  # bounded, so that liveness is judged between bursts too
            try:
                identity, data = self.router.recv_multipart(zmq.NOBLOCK)
                message = msg.decode_from_engine(data)
            except zmq.Again:
                break
            except (ValueError, msgspec.DecodeError, msgspec.ValidationError):
                logger.warning("dropping a malformed engine message")
                continue
            name = identity.decode(errors="replace")
            if isinstance(message, msg.Heartbeat):
                self._on_heartbeat(name, message, now)
            elif isinstance(message, msg.Leaving):
                self._on_leaving(name, message)
            elif message.instance == name:
                arrivals.append(Arrival(now, message))
        if arrivals:
            self.loop.call_soon_threadsafe(self.on_outputs, arrivals)

    def _on_heartbeat(self, name: str, hb: msg.Heartbeat, now: float) -> None:
        inst = self.table.get(name)
        if inst is None or inst.role != hb.role:
            logger.info("engine %s (%s) registered", name, hb.role)
            inst = self.table[name] = Instance(name, hb.role, since=now)
        inst.heartbeat, inst.last_seen = hb, now
        if inst.state == EngineState.LEFT and hb.state == "draining":
            return  # its last heartbeats on the way out
        self._set_state(inst, self._heartbeat_state(hb), now)

    @staticmethod
    def _heartbeat_state(hb: msg.Heartbeat) -> EngineState:
        if hb.state == "starting":
            return EngineState.STARTING
        if hb.state == "draining":
            return EngineState.LEFT
        return EngineState.STALLED if hb.state == "stalled" else EngineState.READY

    def _on_leaving(self, name: str, leaving: msg.Leaving) -> None:
        inst = self.table.get(name)
        if inst is not None:
            inst.why = leaving.reason
            self._set_state(inst, EngineState.LEFT, time.monotonic())

    def _judge(self, now: float) -> None:
        for inst in self.instances():
            if inst.state in (EngineState.DEAD, EngineState.LEFT):
                continue
            silent = now - inst.last_seen
            hb = inst.heartbeat
            if silent > self.dead_after_s:
                inst.why = f"no heartbeat for {silent:.1f} s (--dead-after-s {self.dead_after_s:g})"
                self._set_state(inst, EngineState.DEAD, now)
            elif inst.state == EngineState.STALLED and hb is not None and hb.busy_s > self.stall_dead_after_s:
                inst.why = f"one step has run for {hb.busy_s:.0f} s (--stall-dead-after-s {self.stall_dead_after_s:g})"
                self._set_state(inst, EngineState.DEAD, now)

    def _set_state(self, inst: Instance, state: EngineState, now: float) -> None:
        if state == inst.state:
            return
        old, inst.state, inst.since = inst.state, state, now
        hb = inst.heartbeat
        if state == EngineState.DEAD:
            self.deaths += 1
            logger.error("engine %s declared dead: %s; failing over its requests", inst.name, inst.why)
        elif state == EngineState.STALLED:
            self.stalls += 1
            logger.warning("engine %s stalled: a step running for %.1f s, past %.1f s (10x what its recent steps "
                           "predict for this one, at least 10 s; recent step p99 %.3f s)", inst.name, hb.busy_s,
                           hb.stall_after_s, hb.step_p99_s)
        elif state == EngineState.LEFT:
            logger.info("engine %s is leaving: %s", inst.name, inst.why or "draining")
        elif old in (EngineState.STALLED, EngineState.DEAD):
            logger.info("engine %s is %s again (was %s)", inst.name, state, old)

    def _forward(self) -> None:
        while True:
            try:
                frames = self._out_far.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.router.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError as e:
                logger.warning("could not send to %s: %s", frames[0].decode(errors="replace"), e)

    # -- refused connections ---------------------------------------------------------------

    def _read_monitor(self) -> None:
        while True:
            try:
                parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            self._refused("", "no CURVE handshake: the process has no cluster key")

    def _refused(self, peer: str, why: str) -> None:
        """A process that failed the engine socket's handshake (also called by the ZAP thread)."""
        self.refused_connections += 1
        now, key = time.monotonic(), peer or "?"
        if now - self._warned.get(key, 0.0) >= WARN_EVERY_S:
            self._warned[key] = now
            logger.warning("refused an engine connection from %s on %s: %s (%d refused so far; logged at most "
                           "every %g s per peer)", peer or "an unknown peer", self.bind_addr, why,
                           self.refused_connections, WARN_EVERY_S)
