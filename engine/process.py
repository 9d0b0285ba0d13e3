"""The main loop of one engine process, whatever its role (colocated, prefill or decode).

Each iteration reads like the design: receive (requests and aborts from the server, KV that
landed) -> one engine step (schedule -> execute -> update) -> send (tokens to the server) ->
heartbeat. What differs between roles is the KV connector, chosen once in `__init__`: the loop
itself has no role branches.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from engine import messages as msg
from engine.config import ClusterKey, EngineConfig, KVTransferConfig
from engine.core import EngineCore
from engine.types import EngineRole, FinishReason
from kv_transfer.connector import get_kv_connector
from kv_transfer.handshake import compat_description
from scheduler.scheduler import RequestUpdate

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.2
IDLE_POLL_MS = 20


class EngineProcess:
    def __init__(self, role: EngineRole | str, config: EngineConfig, name: str, server_addr: str,
                 cluster_key: ClusterKey | None = None, **kv) -> None:
        """`kv`: the KVTransferConfig fields with a `kv_` prefix (kv_addr, kv_lease_s, ...).
        `cluster_key` (default: from PDSERVE_CLUSTER_KEY[_FILE]) secures the link and the KV sockets."""
        try:
            self.role = EngineRole(role)
        except ValueError:
            raise ValueError(f"role must be colocated, prefill or decode, got {role!r}") from None
        self.name = name
        self.core = EngineCore(dataclasses.replace(config, instance_name=name))
        self.zmq = zmq.Context()
        # One DEALER to the front end's ROUTER, identified by our name: requests come in, tokens and
        # heartbeats go out. Engines connect to the front end, so it discovers them by their heartbeats
        # (any number, on any host, coming and going) and needs no list of addresses.
        self.link = self.zmq.socket(zmq.DEALER)
        self.link.setsockopt(zmq.IDENTITY, name.encode())
        self.link.setsockopt(zmq.LINGER, 0)
        cluster_key = cluster_key or ClusterKey.from_env()
        if cluster_key is not None:
            cluster_key.secure_client(self.link)
        self.link.connect(server_addr)
        runner = self.core.runner
        compat = compat_description(config, self.core.model_config, runner.num_kv_layers)
        kv_config = KVTransferConfig(**{k.removeprefix("kv_"): v for k, v in kv.items()})
        self.connector = get_kv_connector(self.role, self.zmq, runner.kv_cache, compat, name,
                                          self.core.block_manager.free_blocks, kv_config, cluster_key)
        self.core.set_kv_connector(self.connector)
        self.stopping = False
        self.busy_loop_s = 0.0
        self.last_heartbeat = 0.0
        self.last_tick = time.monotonic()
        # Fault-injection knob for tests and drills: slow every step down (seconds).
        self.step_delay = float(os.environ.get("PDSERVE_DEBUG_STEP_DELAY", "0"))
        self.fault_exit = FaultExitOnPrompt.from_env()
        endpoint = self.connector.kv_endpoint
        logger.info("%s engine %s connected to %s%s", role, name, server_addr,
                    f", KV port {endpoint}" if endpoint else "")

    # -- main loop -----------------------------------------------------------------------

    def run(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        poller = zmq.Poller()
        poller.register(self.link, zmq.POLLIN)
        try:
            while not self.stopping:
                self.last_tick = time.monotonic()  # liveness: the loop is turning
                self._wait_for_input(poller)
                start, steps = time.perf_counter(), self.core.step_times.steps
                self._receive()                        # requests and aborts from the server
                updates = self.core.receive_kv()       # KV transfers that landed or failed
                if self.step_delay and self.core.has_unfinished():
                    time.sleep(self.step_delay)
                updates += self.core.step()            # schedule -> execute -> update
                self._send_updates(updates)            # tokens and errors to the server
                self._heartbeat()
                if self.core.step_times.steps != steps:  # a turn that ran the model: what it cost in all
                    self.busy_loop_s += time.perf_counter() - start
        finally:
            self.close()

    def _wait_for_input(self, poller: zmq.Poller) -> None:
        """Block briefly when idle; never when there is work. The KV sockets wake us up too."""
        registered = {s for s, _ in poller.sockets}
        for sock in self.connector.sockets():  # a decode engine opens one per prefill peer
            if sock not in registered:
                poller.register(sock, zmq.POLLIN)
        poller.poll(0 if self.core.has_unfinished() else IDLE_POLL_MS)

    # -- receive -------------------------------------------------------------------------

    def _receive(self) -> None:
        while True:
            try:
                data = self.link.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = msg.decode_to_engine(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self._refuse(data, e)
                continue
            if isinstance(message, msg.Submit):
                self._submit(message)
            elif isinstance(message, msg.Abort):
                self.core.abort_request(message.req_id, message.transfer_id or None)
            elif isinstance(message, msg.Shutdown):
                self.stopping = True

    def _submit(self, sub: msg.Submit) -> None:
        if self.fault_exit is not None:
            self.fault_exit.watch(sub.req_id, sub.prompt_token_ids)
        try:
            self.core.add_request(sub.prompt_token_ids, sub.params, sub.req_id, sub.prefill_endpoint,
                                  sub.transfer_id, sub.output_token_ids)
        except ValueError as e:
            self._emit(msg.Output(self.name, sub.req_id, [], finish_reason=FinishReason.ERROR, error=str(e),
                                  transfer_id=sub.transfer_id))

    def _refuse(self, data: bytes, error: Exception) -> None:
        """A message that does not decode: answer a Submit (its id is readable) with an error."""
        req_id = msg.submit_id(data)
        if req_id is None:
            logger.warning("dropping a malformed message from the server: %s", error)
            return
        self._emit(msg.Output(self.name, req_id, [], finish_reason=FinishReason.ERROR, error=str(error)))

    # -- send ----------------------------------------------------------------------------

    def _send_updates(self, updates: list[RequestUpdate]) -> None:
        if self.fault_exit is not None:
            self.fault_exit.check(updates)
        for u in updates:
            self._emit(msg.Output(self.name, u.req_id, u.new_token_ids, u.first_index, u.new_logprobs, u.finish_reason,
                                  u.error, u.retryable, u.queue_time, u.transfer_id, u.prompt_logprobs,
                                  u.num_cached_tokens))

    def _emit(self, message: msg.Output | msg.Heartbeat) -> None:
        self.link.send(msg.encode(message))

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self.last_heartbeat < HEARTBEAT_S:
            return
        self.last_heartbeat = now
        stats = self.core.stats()
        spec = self.core.scheduler.spec_stats
        counters = {"num_preemptions_total": float(stats.num_preemptions),
                    "spec_decode_num_drafts_total": spec.num_drafts,
                    "spec_decode_num_draft_tokens_total": spec.num_draft_tokens,
                    "spec_decode_num_accepted_tokens_total": spec.num_accepted_tokens,
                    **self._time_counters(), **self.connector.counters()}
        per_position = {"spec_decode_num_accepted_tokens_per_pos_total": [float(n) for n in spec.accepted_per_pos]}
        if self.core.runner.drafter is not None:  # steps by the number of drafts the policy chose
            chosen = self.core.runner.spec_policy.chosen_k_counts
            per_position["spec_decode_num_steps_by_k_total"] = [float(n) for n in chosen]
            if logger.isEnabledFor(logging.DEBUG):  # PDSERVE_LOG_LEVEL=DEBUG: the policy's cost tables
                logger.debug("spec policy: %s", self.core.runner.spec_policy.summary())
        self._emit(msg.Heartbeat(self.name, self.role, self.connector.kv_endpoint,
                                 stats.kv_blocks_free, stats.kv_blocks_total, stats.num_running,
                                 stats.num_waiting, counters, per_position))

    def _time_counters(self) -> dict[str, float]:
        """Where a step's time goes: the loop turn, the engine step inside it, the runner inside that."""
        times = self.core.step_times
        return {"engine_steps_total": float(times.steps), "engine_loop_busy_seconds_total": self.busy_loop_s,
                "engine_step_seconds_total": times.step_s, "engine_forward_seconds_total": times.forward_s}

    def close(self) -> None:
        self.connector.close()
        self.link.close(0)
        self.zmq.term()


class FaultExitOnPrompt:
    """FAULT INJECTION, for tests and drills only: with PDSERVE_FAULT_EXIT_ON_PROMPT="id,id,..." set,
    the engine process exits at once (os._exit, as a crash would) when it is about to emit tokens
    of a request whose prompt contains that token sequence: a "poison" request (tests/test_pd_failover.py)."""

    EXIT_CODE = 86

    def __init__(self, marker: list[int]) -> None:
        self.marker = marker
        self.poisoned: set[str] = set()

    @classmethod
    def from_env(cls) -> FaultExitOnPrompt | None:
        raw = os.environ.get("PDSERVE_FAULT_EXIT_ON_PROMPT", "").strip()
        return cls([int(t) for t in raw.split(",")]) if raw else None

    def watch(self, req_id: str, prompt: list[int]) -> None:
        n = len(self.marker)
        if any(prompt[i : i + n] == self.marker for i in range(len(prompt) - n + 1)):
            self.poisoned.add(req_id)

    def check(self, updates: list[RequestUpdate]) -> None:
        if any(u.req_id in self.poisoned and u.new_token_ids for u in updates):
            logger.error("fault injection (PDSERVE_FAULT_EXIT_ON_PROMPT): exiting on a poison request")
            logging.shutdown()
            os._exit(self.EXIT_CODE)


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
