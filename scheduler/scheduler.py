"""Continuous-batching scheduler: token budget, chunked prefill, prefix cache, preemption by recompute.

`schedule()` first serves running requests (decodes and unfinished prefills) in arrival order,
preempting the newest running request whenever blocks run out, then admits waiting requests
while budget, slots and blocks last. `update_from_output()` applies a step's results: it is the
only place `num_computed_tokens` changes (I4), including taking back rejected drafts.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from engine.request import Request, RequestStatus
from scheduler.block_manager import BlockManager
from scheduler.output import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput, TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class SpecDecodeStats:
    """Acceptance counters, exported under vLLM's spec_decode_* metric names."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step: 1 (the bonus) + accepted drafts, as vLLM reports it."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class RequestUpdate:
    """What one step produced for one request (new tokens, maybe a finish)."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finish_reason: str | None
    first_index: int = 0               # position of new_token_ids[0] among the request's outputs
    queue_time: float | None = None    # set on the first update: arrival -> first scheduled


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 block_manager: BlockManager, num_lookahead_tokens: int = 0) -> None:
        self.max_num_seqs = max_num_seqs
        # Speculative decoding writes draft KV this far past the scheduled tokens: reserve blocks for it.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.blocks = block_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Slots the runner must free at the start of the next step.
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()
        # Prefill role: finished requests whose blocks wait for the KV transfer (released on ack/lease expiry).
        self.held: dict[str, Request] = {}

    # -- queue management ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def add_prefilled_request(self, request: Request) -> None:
        """Decode role: a request whose KV arrived from prefill into blocks it already holds.

        It goes to the front of the queue: it holds memory, so running it soonest frees it soonest.
        """
        self.requests[request.req_id] = request
        self.waiting.appendleft(request)

    def release_held(self, req_id: str) -> bool:
        request = self.held.pop(req_id, None)
        if request is None:
            return False
        self.blocks.free_request(request)
        return True

    def abort_request(self, req_id: str) -> bool:
        if self.release_held(req_id):
            return True
        request = self.requests.get(req_id)
        if request is None or request.is_finished:
            return False
        self._finish(request, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_uncomputed = request.num_tokens - request.num_computed_tokens
            num_new = min(num_uncomputed + len(request.spec_token_ids), budget,
                          self.max_model_len - request.num_computed_tokens)
            new_blocks = self.blocks.allocate(request, num_new + self.num_lookahead_tokens)
            while new_blocks is None:
                victim = self.running.pop()  # newest first: it has the least work to lose
                self._preempt(victim)
                out.preempted_req_ids.add(victim.req_id)
                if victim is request:
                    break
                new_blocks = self.blocks.allocate(request, num_new + self.num_lookahead_tokens)
            if new_blocks is None:
                break
            out.cached_requests.append(CachedRequestData(request.req_id, request.num_computed_tokens, new_blocks))
            out.num_scheduled_tokens[request.req_id] = num_new
            num_drafts = max(0, num_new - num_uncomputed)
            if num_drafts:
                out.num_draft_tokens[request.req_id] = num_drafts
            budget -= num_new
            i += 1

        # Admit waiting requests in order, unless memory was just short (they would only be
        # preempted). When one does not fit, only requests that already hold their blocks (PD
        # handoffs) may still go ahead: they need little more, and waiting on them could deadlock.
        blocked = False
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs or out.preempted_req_ids:
                break
            if blocked and not request.block_ids:
                continue
            cached = self.blocks.find_cached_prefix(request) if request.num_computed_tokens == 0 else []
            num_computed = request.num_computed_tokens + len(cached) * self.blocks.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            if self.blocks.allocate(request, num_new + self.num_lookahead_tokens, cached) is None:
                blocked = True
                continue
            self.waiting.remove(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.new_requests.append(NewRequestData(
                req_id=request.req_id, prompt_len=request.prompt_len, all_token_ids=list(request.all_token_ids),
                num_computed_tokens=num_computed, block_ids=list(request.block_ids),
                sampling_params=request.sampling_params))
            out.num_scheduled_tokens[request.req_id] = num_new
            budget -= num_new
        return out

    def update_from_output(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        for idx, req_id in enumerate(result.req_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            sampled = result.sampled_token_ids[idx]
            request.num_computed_tokens += sched.num_scheduled_tokens[req_id]
            if sampled:
                # Verified 1 + k positions, kept len(sampled) tokens: the KV of the rejected
                # drafts is garbage and must be recomputed (I4: only the scheduler adjusts this).
                num_drafts = sched.num_draft_tokens.get(req_id, 0)
                request.num_computed_tokens -= num_drafts + 1 - len(sampled)
                if num_drafts:
                    self.spec_stats.record(num_drafts, len(sampled) - 1)
            request.spec_token_ids = list(result.draft_token_ids[idx]) if result.draft_token_ids else []
            self.blocks.cache_full_blocks(request)

            new_tokens: list[int] = []
            logprobs = result.logprobs[idx] if result.logprobs else []
            finish = None
            for token in sampled:
                request.append_output(token)
                new_tokens.append(token)
                finish = request.check_stop(self.max_model_len)
                if finish:  # tokens after a stop are discarded, never streamed
                    break
            request.output_logprobs.extend(logprobs[: len(new_tokens)])
            if finish:
                self._finish(request, finish)
            if new_tokens or finish:
                first = len(request.output_token_ids) - len(new_tokens)
                queue_time = None
                if first == 0 and request.first_scheduled_time is not None:
                    queue_time = request.first_scheduled_time - request.arrival_time
                updates.append(RequestUpdate(req_id, new_tokens, logprobs[: len(new_tokens)], finish, first, queue_time))
        for req_id in list(self.requests):
            if self.requests[req_id].is_finished:
                del self.requests[req_id]
        return updates

    # -- helpers ---------------------------------------------------------------------------

    def _preempt(self, request: Request) -> None:
        self.blocks.free_request(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
            self._finished_ids.add(request.req_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        if reason == "prefilled":
            self.held[request.req_id] = request  # blocks stay until the transfer is acked
        else:
            self.blocks.free_request(request)
