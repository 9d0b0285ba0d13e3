"""The main loop of one engine process, whatever its role (colocated, prefill or decode).

Each iteration reads like the design: receive (requests and aborts from the server, KV that
landed) -> one engine step (schedule -> execute -> update) -> send (tokens to the server). The
heartbeat is not part of it: a thread of the link sends it (engine/link.py), whatever the step costs.
What differs between roles is the KV connector, chosen once in `__init__`: the loop
itself has no role branches.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from engine import messages as msg
from engine import settings
from engine.cluster_key import ClusterKey
from engine.config import EngineConfig, KVTransferConfig
from engine.core import EngineCore
from engine.grammar_prep import GrammarPrep
from engine.link import HEARTBEAT_S, FrontEndLink
from engine.loop_watch import LoopWatch
from engine.types import EngineRole, FinishReason
from kv_transfer.connector import get_kv_connector
from kv_transfer.handshake import compat_description
from scheduler.scheduler import RequestUpdate

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 20
EXIT_NOT_REGISTERED = 3  # the front end never accepted this engine (see engine/link.py)


class EngineProcess:
    def __init__(self, role: EngineRole | str, config: EngineConfig, name: str, server_addr: str,
                 kv: KVTransferConfig | None = None, cluster_key: ClusterKey | None = None,
                 register_timeout_s: float = 60.0) -> None:
        """`config` as given; what the role changes in it is `EngineConfig.for_role`'s. `kv`: the KV
        port's settings (default: KVTransferConfig()). `cluster_key` (default: from
        PDSERVE_CLUSTER_KEY[_FILE]) secures the link and the KV sockets.
        `register_timeout_s`: exit (non-zero) when the front end never accepts our handshake by then."""
        try:
            self.role = EngineRole(role)
        except ValueError:
            raise ValueError(f"role must be colocated, prefill or decode, got {role!r}") from None
        self.name = name
        self.core = EngineCore(dataclasses.replace(config.for_role(self.role), instance_name=name))
        self.core.warm_up()  # before the front end hears of us: a new engine gets work once it has stepped
        self.zmq = zmq.Context()
        cluster_key = cluster_key or ClusterKey.from_env()
        runner = self.core.runner
        compat = compat_description(config, self.core.model_config, runner.num_kv_layers)
        self.connector = get_kv_connector(self.role, self.zmq, runner.kv_cache, compat, name,
                                          self.core.block_manager.free_blocks, kv or KVTransferConfig(), cluster_key)
        self.core.set_kv_connector(self.connector)
        self.grammar_prep = GrammarPrep(self.core.compile_grammar)  # grammars compile off the loop
        self.stopping = False
        self.failed: str | None = None   # why the loop gave up (the process then exits non-zero)
        self.busy_loop_s = 0.0
        self.watch = LoopWatch(lambda: self.core.step_tokens)
        self._status = self._engine_status()
        self._status_at = time.monotonic()
        # Fault-injection knob for tests and drills: slow every step down (seconds).
        self.step_delay = settings.DEBUG_STEP_DELAY.get()
        self.fault_exit = FaultExitOnPrompt.from_env()
        # The link to the front end runs in a thread of its own (engine/link.py): it heart-beats
        # while a step runs, and the loop never blocks on the front end. Engines connect to the
        # front end, so it discovers them by their heartbeats and needs no list of addresses.
        self.link = FrontEndLink(self.zmq, server_addr, name, cluster_key, self._heartbeat, register_timeout_s)
        endpoint = self.connector.kv_endpoint
        logger.info("%s engine %s connecting to %s%s", role, name, server_addr,
                    f", KV port {endpoint}" if endpoint else "")

    # -- main loop -----------------------------------------------------------------------

    def run(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        poller = zmq.Poller()
        poller.register(self.link.pipe, zmq.POLLIN)
        try:
            while not self.stopping:
                self.failed = self.link.failed
                if self.failed:
                    break
                self.watch.tick()                      # liveness: the loop is turning
                self._wait_for_input(poller)
                self.watch.begin()
                start, steps = time.perf_counter(), self.core.step_times.steps
                self._receive()                        # requests and aborts from the server
                updates = self.core.receive_kv()       # KV transfers that landed or failed
                if self.step_delay and self.core.has_unfinished():
                    time.sleep(self.step_delay)
                updates += self.core.step()            # schedule -> execute -> update
                self._send_updates(updates)            # tokens and errors to the server
                ran_model = self.core.step_times.steps != steps
                self.watch.end(ran_model)
                if ran_model:  # a turn that ran the model: what it cost in all
                    self.busy_loop_s += time.perf_counter() - start
                self._refresh_status()
            self._leave()
        finally:
            self.close()

    def _wait_for_input(self, poller: zmq.Poller) -> None:
        """Block briefly when idle; never when there is work. The KV sockets wake us up too."""
        registered = {s for s, _ in poller.sockets}
        for sock in self.connector.sockets():  # a decode engine opens one per prefill peer
            if sock not in registered:
                poller.register(sock, zmq.POLLIN)
        poller.poll(0 if self.core.has_unfinished() else IDLE_POLL_MS)

    def _leave(self) -> None:
        """SIGTERM (or Shutdown): tell the front end first, so that it routes nothing more here and
        resumes what this engine holds elsewhere at once; the requests end here with the process."""
        if self.failed:
            return
        self.watch.draining = True
        held = list(self.core.scheduler.requests)
        self.link.send(msg.Leaving(self.name, f"shutting down with {len(held)} request(s) in flight"))
        logger.info("%s engine %s leaving: %d request(s) handed back to the front end", self.role, self.name,
                    len(held))

    # -- receive -------------------------------------------------------------------------

    def _receive(self) -> None:
        while (data := self.link.recv()) is not None:
            try:
                message = msg.decode_to_engine(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self._refuse(data, e)
                continue
            if isinstance(message, msg.Submit):
                self._submit(message)
            elif isinstance(message, msg.Abort):
                if self.grammar_prep.drop(message.req_id, message.transfer_id or None) is None:
                    self.core.abort_request(message.req_id, message.transfer_id or None)
            elif isinstance(message, msg.Shutdown):
                self.stopping = True
        for ready in self.grammar_prep.ready():
            if ready.error is not None:
                self._fail(ready.item, ready.error)
            else:
                self._add(ready.item, ready.grammar)

    def _submit(self, sub: msg.Submit) -> None:
        """A request with a grammar waits for it to compile (engine/grammar_prep.py) before it is
        queued; what can be checked without compiling is checked at once."""
        if self.fault_exit is not None:
            self.fault_exit.watch(sub.req_id, sub.prompt_token_ids)
        if sub.params.grammar is None:
            self._add(sub, None)
            return
        try:
            self.core.validate_prompt(sub.prompt_token_ids, sub.params)
        except ValueError as e:
            self._fail(sub, str(e))
            return
        if (error := self.grammar_prep.start(sub.req_id, sub.params.grammar, sub, sub.transfer_id)) is not None:
            self._fail(sub, error)

    def _add(self, sub: msg.Submit, grammar: Any) -> None:
        try:
            self.core.add_request(sub.prompt_token_ids, sub.params, sub.req_id, sub.kv_endpoint,
                                  sub.transfer_id, sub.output_token_ids, grammar=grammar)
        except ValueError as e:
            self._fail(sub, str(e))

    def _fail(self, sub: msg.Submit, error: str) -> None:
        self._emit(msg.Output(self.name, sub.req_id, [], finish_reason=FinishReason.ERROR, error=error,
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

    def _emit(self, message: msg.Output) -> None:
        self.link.send(message)

    # -- heartbeat -----------------------------------------------------------------------

    def _refresh_status(self) -> None:
        """The engine's state for the heartbeat, taken between steps (the heartbeat thread must not
        read the scheduler while the loop changes it)."""
        now = time.monotonic()
        if now - self._status_at >= HEARTBEAT_S:
            self._status, self._status_at = self._engine_status(), now

    def _heartbeat(self) -> msg.Heartbeat:
        """Called by the link's thread: the last status, with the loop's liveness as of now."""
        status, watch = self._status, self.watch
        return msgspec.structs.replace(status, state=watch.state(), busy_s=watch.busy_s(),
                                       step_p99_s=watch.step_p99_s(), stall_after_s=watch.stall_after_s())

    def _engine_status(self) -> msg.Heartbeat:
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
        return msg.Heartbeat(self.name, self.role, self.connector.kv_endpoint, stats.kv_blocks_free,
                             stats.kv_blocks_total, stats.num_running,
                             stats.num_waiting + len(self.grammar_prep),  # waiting for their grammar count too
                             counters, per_position)

    def _time_counters(self) -> dict[str, float]:
        """Where a step's time goes: the loop turn, the engine step inside it, the runner inside that."""
        times = self.core.step_times
        return {"engine_steps_total": float(times.steps), "engine_loop_busy_seconds_total": self.busy_loop_s,
                "engine_step_seconds_total": times.step_s, "engine_forward_seconds_total": times.forward_s}

    def close(self) -> None:
        self.grammar_prep.close()
        self.link.close()
        self.connector.close()
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
        raw = settings.FAULT_EXIT_ON_PROMPT.get()
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


def run_engine_process(role: str, config: EngineConfig, name: str, server_addr: str, kv: KVTransferConfig,
                       on_engine: Callable[[EngineProcess], None] | None = None,
                       register_timeout_s: float = 60.0) -> None:
    """Entry point of a child process (or the `pdserve prefill|decode|colocated` commands).

    `on_engine` sees the engine once its model is loaded, before the loop starts (the
    `--health-port` endpoint attaches itself there)."""
    logging.basicConfig(level=settings.LOG_LEVEL.get(),
                        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    engine = EngineProcess(role, config, name, server_addr, kv, register_timeout_s=register_timeout_s)
    if on_engine is not None:
        on_engine(engine)
    engine.run()
    if engine.failed:
        logger.error("%s engine %s: %s; exiting", role, name, engine.failed)
        logging.shutdown()
        sys.exit(EXIT_NOT_REGISTERED)
