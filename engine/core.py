"""The engine core of one process: scheduler + model runner + KV connector, stepped in a loop.

`receive_kv()` takes in the KV transfers that landed (PD), `step()` reads like the design:
schedule -> execute -> update.
Input validation lives in `add_request`, so bad input raises a ValueError before it can touch
running requests. Whatever still goes wrong while a batch runs (an exception in the runner, such
as a sampled id outside the vocabulary) fails the requests of that batch, never the process.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineConfig, ModelConfig
from engine.grammar import check_refs
from engine.request import Request
from engine.types import EngineRole, GrammarSpec, SamplingParams
from engine.validation import check_prompt, check_resumed_outputs, check_token_ids
from kv_transfer.connector import KVConnector
from scheduler.block_manager import BlockManager
from scheduler.output import SchedulerOutput
from scheduler.scheduler import RequestUpdate, Scheduler, SpecDecodeStats
from scheduler.step_cost import StepCost
from worker.invariants import InvariantViolation
from worker.kv_tap import KVTap
from worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int  # includes requests whose KV is still on its way (decode role)
    kv_blocks_free: int
    kv_blocks_total: int
    num_preemptions: int


@dataclass
class StepTimes:
    """Where the engine's time goes (seconds, summed over steps that ran the model)."""

    steps: int = 0
    step_s: float = 0.0     # schedule + execute + update
    forward_s: float = 0.0  # the runner: inputs, model forward, sampling, drafting
    failed_steps: int = 0   # steps whose runner raised (their requests failed, see EngineCore._fail_step)


# The longer warm-up prompt: long enough that its arithmetic shows next to a step's fixed cost on a
# model worth measuring, short enough to cost little at start-up on any.
WARM_UP_FIT_TOKENS = 32


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.model_config = ModelConfig.from_dir(config.model)
        config.validate(self.model_config)
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, self.model_config)
        num_blocks = self.runner.num_kv_blocks
        if num_blocks * config.block_size < config.max_model_len:
            raise ValueError(f"num_kv_blocks: {num_blocks} blocks of {config.block_size} tokens cannot hold one "
                             f"request of max_model_len={config.max_model_len}; "
                             "raise num_kv_blocks or lower max_model_len")
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.connector = KVConnector()  # colocated; an engine process may set its role's connector
        self.step_times = StepTimes()
        self.step_tokens = 0  # tokens scheduled in the step in progress (read by the liveness watch)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
                                   self.block_manager, self.connector, config.num_lookahead_tokens, StepCost())
        logger.info("engine ready: model=%s dtype=%s device=%s kv_blocks=%d x %d tokens", config.model, config.dtype,
                    config.device, num_blocks, config.block_size)

    def set_kv_connector(self, connector: KVConnector) -> None:
        """Before the first request: the connector of this engine's role."""
        self.connector = self.scheduler.connector = connector
        connector.step_seconds = self.scheduler.step_cost.predict
        if connector.taps_layers:  # prefill: attention reports each layer's KV writes to the connector
            self.runner.kv_tap = KVTap(self.runner.kv_cache, self.config.block_size, connector.tap_target,
                                       connector.on_layer, connector.snapshots, connector.on_layers_done,
                                       connector.on_hidden)

    def warm_up(self) -> None:
        """Short prompts through schedule -> execute -> update, one output token each, before the
        engine takes any work: the first step of a process builds kernels and their caches (seconds
        on a large model), and a runtime that cannot run the model fails here rather than on a user's
        request. Two more prompts of different lengths give the step-cost fit (StepCost) its first
        points, so the first burst of prompts is batched as this model's steps warrant. It leaves
        nothing behind: its blocks are freed and forgotten by the prefix cache, and the counters
        start from zero. Only a colocated connector is set at this point."""
        assert self.connector.role == EngineRole.COLOCATED, "warm up before setting a PD connector"
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        fit_len = min(WARM_UP_FIT_TOKENS, self.config.max_model_len - 1)
        for i, length in enumerate((2, 2, fit_len)):
            self.add_request([0] * length, params, req_id=f"warm-up-{i}")
            while self.has_unfinished():
                self.step()
            if i == 0:  # its cost is the kernels' first builds, not a step's
                self.scheduler.step_cost.reset()
        self.block_manager.reset_prefix_cache()  # no user prompt may hit the warm-up's blocks
        self.step_times = StepTimes()
        self.scheduler.spec_stats = SpecDecodeStats()
        if self.runner.drafter is not None:
            self.runner.spec_policy.chosen_k_counts = [0] * len(self.runner.spec_policy.chosen_k_counts)

    # -- requests ------------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_prompt(prompt_token_ids, self.model_config.vocab_size, self.config.max_model_len)
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        check_token_ids(params.stop_token_ids, self.model_config.vocab_size, "stop_token_ids")

    def compile_grammar(self, spec: GrammarSpec) -> Any:
        """`spec` compiled against this engine's vocabulary (cached by spec); a ValueError naming the
        field when it cannot be. Safe from any thread: an engine process calls it from its grammar
        thread (engine/grammar_prep.py), never from a step."""
        try:
            check_refs(spec)
            return self.runner.grammar.compiler.compile(spec)
        except ValueError as exc:
            raise ValueError(f"sampling_params.grammar: {exc}") from None

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, req_id: str | None = None,
                    kv_endpoint: str = "", transfer_id: str = "",
                    output_token_ids: list[int] | None = None, grammar: Any = None) -> str:
        """Validate and queue; `kv_endpoint` (decode role) is the KV address of the prefill instance
        the prompt's KV comes from, `transfer_id` (PD) names this attempt's KV transfer.
        `output_token_ids`: a resumed request's tokens already streamed to the client (failover);
        generation goes on after them. `grammar`: `params.grammar` compiled (`compile_grammar`);
        without it a grammar is compiled here, on the caller's thread (the offline API and tests; an
        engine process compiles beforehand)."""
        self.validate_prompt(prompt_token_ids, params)
        outputs = list(output_token_ids or [])
        check_resumed_outputs(outputs, len(prompt_token_ids), params.max_tokens, self.model_config.vocab_size,
                              self.config.max_model_len)
        if params.grammar is not None and grammar is None:
            grammar = self.compile_grammar(params.grammar)
        req_id = req_id or uuid.uuid4().hex
        if req_id in self.scheduler.requests:
            raise ValueError(f"request_id {req_id!r} is already in use")
        request = Request(req_id, list(prompt_token_ids), params, self.model_config.eos_token_ids,
                          output_token_ids=outputs, transfer_id=transfer_id, grammar=grammar)
        self.connector.on_new_request(request, kv_endpoint)
        try:
            self.scheduler.add_request(request)
        except ValueError:
            self.connector.abort(req_id, transfer_id)
            raise
        return req_id

    def abort_request(self, req_id: str, transfer_id: str | None = None) -> bool:
        """Abort a request (`transfer_id`: only if it is that attempt's; the scheduler has one per id)."""
        self.connector.abort(req_id, transfer_id)
        request = self.scheduler.requests.get(req_id)
        if transfer_id is not None and request is not None and request.transfer_id != transfer_id:
            return False  # an abort of an older attempt: the request here is a newer one
        return self.scheduler.abort_request(req_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop body -------------------------------------------------------------------

    def step(self) -> list[RequestUpdate]:
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        self.step_tokens = sched.total_num_scheduled_tokens
        if sched.is_empty:  # an idle engine process steps too (to reserve KV): skip the runner then
            return []
        if sched.new_requests:
            self.connector.on_scheduled([new.req_id for new in sched.new_requests])
        forward_start = time.perf_counter()
        try:
            result = self.runner.execute_model(sched)
        except InvariantViolation:  # a bug in the engine's own bookkeeping (debug checks): never hidden
            raise
        except Exception as exc:  # one batch's failure, not the engine's: its requests end, the loop goes on
            return self._fail_step(sched, exc)
        forward_end = time.perf_counter()
        updates = self.scheduler.update_from_output(sched, result)
        step_s = time.perf_counter() - start
        self.scheduler.step_cost.record(sched.total_num_scheduled_tokens, step_s)
        times = self.step_times
        times.steps += 1
        times.forward_s += forward_end - forward_start
        times.step_s += step_s
        return updates

    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> list[RequestUpdate]:
        """execute_model raised: end every request of the step with a (not retryable) error.

        What the runner did before it raised is unknown -- slots admitted, tokens written back, KV
        written -- so nothing of it is trusted: the requests are finished here (their blocks freed;
        nothing of this step enters the prefix cache), and their slots, with those the step was to
        free, are freed at the start of the next step (the runner's removals are idempotent, and
        admission resets a slot entirely, I2).
        Requests outside the step never entered the runner's hands and go on untouched."""
        req_ids = list(sched.num_scheduled_tokens)
        logger.exception("a step of %d requests failed; failing them: %s", len(req_ids), req_ids)
        error = f"the engine failed to run this request's batch: {type(exc).__name__}: {exc}"
        updates = [self.scheduler.fail_request(req_id, error) for req_id in req_ids]
        self.scheduler.free_slots_again(sched.finished_req_ids | sched.preempted_req_ids)
        self.step_times.failed_steps += 1
        return [u for u in updates if u is not None]

    def receive_kv(self) -> list[RequestUpdate]:
        """KV transfers that finished since the last call: loaded requests may run from the next
        step, failed ones end (their updates). A no-op without a KV connector (colocated)."""
        loaded, failed = self.connector.poll()
        updates = [self.scheduler.kv_loaded(item.req_id, item.t0, item.num_tokens, item.hidden) for item in loaded]
        return [u for u in updates if u is not None] + [self.scheduler.kv_failed(item.req_id, item.reason,
                                                                                 item.retryable) for item in failed]

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), self.block_manager.num_free_blocks,
                           self.block_manager.num_blocks, s.num_preemptions)
