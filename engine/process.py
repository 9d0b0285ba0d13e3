"""The main loop of one engine process (role colocated, prefill or decode).

Each iteration reads like the design: receive (requests, aborts, KV) -> schedule + execute +
update (one engine step) -> send (tokens to the server, KV hand-offs) -> housekeeping.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from engine import messages as msg
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import Request
from engine.sampling_params import SamplingParams
from kv_transfer.handshake import compat_description, compat_hash
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.2
IDLE_POLL_MS = 20


class EngineProcess:
    def __init__(self, role: str, config: EngineConfig, name: str, server_addr: str, kv_addr: str = "",
                 kv_advertise: str = "", kv_key: str = "", kv_lease_s: float = 30.0, kv_deadline_s: float = 60.0) -> None:
        if role not in ("colocated", "prefill", "decode"):
            raise ValueError(f"role must be colocated, prefill or decode, got {role!r}")
        self.role, self.name = role, name
        self.core = EngineCore(dataclasses.replace(config, instance_name=name))
        self.zmq = zmq.Context()
        # One DEALER to the front end's ROUTER, identified by our name: requests come in, tokens and
        # heartbeats go out. Engines connect to the front end, so it discovers them by their heartbeats
        # (any number, on any host, coming and going) and needs no list of addresses.
        self.link = self.zmq.socket(zmq.DEALER)
        self.link.setsockopt(zmq.IDENTITY, name.encode())
        self.link.setsockopt(zmq.LINGER, 0)
        self.link.connect(server_addr)
        runner = self.core.runner
        desc = compat_description(config, self.core.model_config, runner.num_kv_layers)
        chash, desc_text = compat_hash(desc), str(desc)
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        if role == "prefill":
            self.sender = KVSender(self.zmq, kv_addr or "tcp://127.0.0.1:0", runner.kv_cache, chash, desc_text, name,
                                   self.core.scheduler.release_held, kv_lease_s, kv_key)
        elif role == "decode":
            self.receiver = KVReceiver(self.zmq, runner.kv_cache, chash, desc_text, name, kv_deadline_s, kv_key)
        self.kv_endpoint = kv_advertise or (advertised(self.sender.address) if self.sender else "")
        # Decode role: requests waiting for blocks, then for their KV.
        self.unreserved: list[tuple[Request, str]] = []
        self.awaiting_kv: dict[str, Request] = {}
        self.stopping = False
        self.last_heartbeat = 0.0
        self.last_tick = time.monotonic()
        # Fault-injection knob for tests and drills: slow every step down (seconds).
        self.step_delay = float(os.environ.get("PDSERVE_DEBUG_STEP_DELAY", "0"))
        logger.info("%s engine %s connected to %s%s", role, name, server_addr,
                    f", KV port {self.kv_endpoint}" if self.sender else "")

    # -- main loop -----------------------------------------------------------------------

    def run(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        poller = zmq.Poller()
        poller.register(self.link, zmq.POLLIN)
        if self.sender:
            poller.register(self.sender.socket, zmq.POLLIN)
        try:
            while not self.stopping:
                self.last_tick = time.monotonic()  # liveness: the loop is turning
                busy = self.core.has_unfinished()
                self._register_new_peers(poller)
                poller.poll(0 if busy else IDLE_POLL_MS)
                self._receive()
                self._transfer_kv()
                if self.core.has_unfinished():
                    if self.step_delay:
                        time.sleep(self.step_delay)
                    self._send_updates(self.core.step())
                self._heartbeat()
        finally:
            self.close()

    def _register_new_peers(self, poller: zmq.Poller) -> None:
        if self.receiver:
            registered = {s for s, _ in poller.sockets}
            for sock in self.receiver.sockets():
                if sock not in registered:
                    poller.register(sock, zmq.POLLIN)

    # -- receive -------------------------------------------------------------------------

    def _receive(self) -> None:
        while True:
            try:
                data = self.link.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = msg.decode_to_engine(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                logger.warning("dropping a malformed message from the server")
                continue
            if isinstance(message, msg.Submit):
                self._submit(message)
            elif isinstance(message, msg.Abort):
                self._abort(message.req_id)
            elif isinstance(message, msg.Shutdown):
                self.stopping = True

    def _submit(self, sub: msg.Submit) -> None:
        try:
            params = SamplingParams(**sub.params)
            self.core.validate_prompt(sub.prompt_token_ids, params)
        except (ValueError, TypeError) as e:
            self._emit(msg.Output(self.name, sub.req_id, [], finish_reason="error", error=str(e)))
            return
        eos = self.core.model_config.eos_token_ids
        if self.role == "decode":
            request = Request(sub.req_id, list(sub.prompt_token_ids), params, eos)
            self.unreserved.append((request, sub.prefill_endpoint))
        else:
            request = Request(sub.req_id, list(sub.prompt_token_ids), params, eos, prefill_only=self.role == "prefill")
            self.core.scheduler.add_request(request)

    def _abort(self, req_id: str) -> None:
        if self.sender:
            self.sender.drop(req_id, "aborted")
        if self.receiver:
            self.receiver.cancel(req_id, "aborted")
            self.unreserved = [(r, e) for r, e in self.unreserved if r.req_id != req_id]
            request = self.awaiting_kv.pop(req_id, None)
            if request is not None:
                self.core.block_manager.free_request(request)
        self.core.abort_request(req_id)

    # -- KV transfer ---------------------------------------------------------------------

    def _transfer_kv(self) -> None:
        if self.sender:
            self.sender.poll()
        if not self.receiver:
            return
        # Reserve blocks for the prompt + t0 (+ lookahead), oldest first; pull once reserved.
        # A preempted request (waiting without blocks) goes first, or new reservations starve it.
        lookahead = self.core.config.num_lookahead_tokens
        starving = any(not r.block_ids for r in self.core.scheduler.waiting)
        while self.unreserved and not starving:
            request, endpoint = self.unreserved[0]
            if self.core.block_manager.allocate(request, request.prompt_len + 1 + lookahead) is None:
                break
            self.unreserved.pop(0)
            self.awaiting_kv[request.req_id] = request
            self.receiver.start(request.req_id, endpoint, request.block_ids)
        done, failed = self.receiver.poll()
        for item in done:
            request = self.awaiting_kv.pop(item.req_id)
            # The handoff (DESIGN.md §1 step 5): prompt + [t0], everything but t0 computed.
            request.append_output(item.t0)
            request.num_computed_tokens = item.num_tokens
            self.core.scheduler.add_prefilled_request(request)
        for item in failed:
            request = self.awaiting_kv.pop(item.req_id, None)
            if request is not None:
                self.core.block_manager.free_request(request)
            self._emit(msg.Output(self.name, item.req_id, [], finish_reason="error", error=item.reason, retryable=True))

    # -- send ----------------------------------------------------------------------------

    def _send_updates(self, updates) -> None:
        for u in updates:
            reason = u.finish_reason
            if reason == "prefilled":
                held = self.core.scheduler.held[u.req_id]
                self.sender.hold(u.req_id, held.block_ids, held.prompt_len, u.new_token_ids[0])
                reason = None  # the request goes on at the decode instance
            lps = [(lp.token_id, lp.logprob, lp.rank, lp.top) for lp in u.new_logprobs]
            self._emit(msg.Output(self.name, u.req_id, u.new_token_ids, u.first_index, lps, reason,
                                  queue_time=u.queue_time))

    def _emit(self, message: msg.Output | msg.Heartbeat) -> None:
        self.link.send(msg.encode(message))

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self.last_heartbeat < HEARTBEAT_S:
            return
        self.last_heartbeat = now
        stats = self.core.stats()
        counters = {"num_preemptions_total": float(stats.num_preemptions)}
        spec = self.core.scheduler.spec_stats
        counters.update({"spec_decode_num_drafts_total": spec.num_drafts,
                         "spec_decode_num_draft_tokens_total": spec.num_draft_tokens,
                         "spec_decode_num_accepted_tokens_total": spec.num_accepted_tokens})
        for pos, n in enumerate(spec.accepted_per_pos):
            counters[f"spec_decode_num_accepted_tokens_per_pos_total{{position={pos}}}"] = n
        if self.core.runner.drafter is not None:  # steps by the number of drafts the policy chose
            counters.update({f"spec_decode_num_steps_by_k_total{{k={k}}}": n
                             for k, n in enumerate(self.core.runner.spec_policy.chosen_k_counts)})
        for part in (self.sender, self.receiver):
            if part is not None:
                counters.update(part.stats.as_counters())
        self._emit(msg.Heartbeat(self.name, self.role, self.kv_endpoint,
                                 stats.kv_blocks_free, stats.kv_blocks_total, stats.num_running,
                                 stats.num_waiting + len(self.unreserved) + len(self.awaiting_kv), counters))

    def close(self) -> None:
        for part in (self.sender, self.receiver):
            if part is not None:
                part.close()
        self.link.close(0)
        self.zmq.term()


def advertised(bound: str) -> str:
    """The address peers should dial for a socket bound on all interfaces (tcp://0.0.0.0:P)."""
    if bound.startswith("tcp://0.0.0.0:"):
        return f"tcp://{socket.gethostbyname(socket.gethostname())}:{bound.rsplit(':', 1)[1]}"
    return bound


def run_engine_process(role: str, config: EngineConfig, name: str, server_addr: str,
                       on_engine: Callable[[EngineProcess], None] | None = None, **kv) -> None:
    """Entry point of a child process (or the `pdserve prefill|decode|colocated` commands).

    `on_engine` sees the engine once its model is loaded, before the loop starts (the
    `--health-port` endpoint attaches itself there)."""
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    engine = EngineProcess(role, config, name, server_addr, **kv)
    if on_engine is not None:
        on_engine(engine)
    engine.run()

