"""Continuous-batching scheduler: token budget, chunked prefill, prefix cache, preemption by recompute.

`schedule()` first reserves blocks for requests whose KV comes from a prefill instance (decode
role; they wait as WAITING_FOR_KV until the KV connector reports it landed), then serves running
requests (decodes and unfinished prefills) in arrival order, preempting the newest running
request whenever blocks run out, then admits waiting requests while budget, slots and blocks
last. `update_from_output()` applies a step's results: it is the only place
`num_computed_tokens` changes (I4), including taking back rejected drafts.

The KV connector (kv_transfer/connector.py) is told when a reservation is made and when a
request finishes; a prefill engine's connector keeps a handed-off request's blocks from there.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.request import DecodeHandoff, Request, RequestStatus
from engine.types import FinishReason, TokenLogprobs
from scheduler.block_manager import BlockManager
from scheduler.output import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput
from scheduler.step_cost import StepCost

if TYPE_CHECKING:
    import torch

    from kv_transfer.connector import KVConnector

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
    finish_reason: FinishReason | None  # never HANDED_OFF: for the client that request goes on
    first_index: int = 0               # position of new_token_ids[0] among the request's outputs
    queue_time: float | None = None    # set on the first update: arrival -> first scheduled
    error: str | None = None
    retryable: bool = False            # an error a fresh prefill may fix (the KV transfer failed)
    transfer_id: str = ""              # PD: the attempt the request belongs to (Request.transfer_id)
    # With the request's first token only (t0: on P under PD):
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.. when asked for
    num_cached_tokens: int | None = None                # prompt tokens that were prefix-cache hits


# Up to how many prefill tokens a prompt joins a step that already prefills another, until the
# engine's own steps tell (StepCost): what a small model's steps cost in Python dwarfs this many
# tokens' arithmetic, and a larger model's steps soon tell otherwise.
DEFAULT_SHARED_PREFILL_TOKENS = 512
# Prompts this short always share a step: their compute is small next to a step on any model, and
# a fit over steps of a few tokens each cannot tell their cost from noise.
MIN_SHARED_PREFILL_TOKENS = 64


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 block_manager: BlockManager, connector: KVConnector, num_lookahead_tokens: int = 0,
                 step_cost: StepCost | None = None) -> None:
        self.max_num_seqs = max_num_seqs
        # Speculative decoding writes draft KV this far past the scheduled tokens: reserve blocks for it.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.blocks = block_manager
        self.connector = connector
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Slots the runner must free at the start of the next step.
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()
        self.step_cost = step_cost or StepCost()  # fed by the engine after each step
        self._step_prefill_tokens = 0  # prompt tokens (not a handoff's t0, not drafts) in the step being built

    # -- queue management ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError for a decode reservation that could never fit, even in
        an empty cache: it would block every reservation behind it for good."""
        if request.awaits_kv:
            need = self.blocks.blocks_needed(request.num_handoff_tokens + 1 + self.num_lookahead_tokens)
            if need > self.blocks.num_blocks:
                raise ValueError(f"prompt: {request.num_handoff_tokens} tokens need {need} KV blocks on this decode "
                                 f"instance (with t0 and {self.num_lookahead_tokens} lookahead slots); it has "
                                 f"{self.blocks.num_blocks} in all")
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def abort_request(self, req_id: str) -> bool:
        request = self.requests.pop(req_id, None)  # forgotten at once: the id may come back (a retry)
        if request is None or request.is_finished:
            return False
        self._finish(request, FinishReason.ABORT)
        return True

    def fail_request(self, req_id: str, error: str) -> RequestUpdate | None:
        """End a request with a (not retryable) error: its step failed (EngineCore._fail_step)."""
        request = self.requests.pop(req_id, None)
        if request is None or request.is_finished:
            return None
        self._finish(request, FinishReason.ERROR)
        # Its slot goes whether it was running or, for a step that failed while admitting it, not.
        self._finished_ids.add(req_id)
        return RequestUpdate(req_id, [], [], FinishReason.ERROR, error=error, transfer_id=request.transfer_id)

    def free_slots_again(self, req_ids: set[str]) -> None:
        """Have the runner free these requests' slots (again) at the next step: a failed step may
        have stopped before it did."""
        self._finished_ids |= req_ids

    def has_unfinished(self) -> bool:
        """Work for the next step: running requests, or waiting ones that need no KV from elsewhere."""
        return bool(self.running) or any(not r.awaits_kv for r in self.waiting)

    # -- KV from a prefill instance (decode role) ------------------------------------------

    def kv_loaded(self, req_id: str, t0: int, num_tokens: int,
                  hidden: torch.Tensor | None = None) -> RequestUpdate | None:
        """The prompt's KV is in the request's reserved blocks: the handoff (docs/architecture.md, the hand-off),
        prompt + [t0] with everything but t0 computed. A resumed request (failover) already holds
        its streamed outputs; P handed back the last of them as t0, and the client has seen it.
        `hidden`: the hidden states P handed over for the MTP drafter (NewRequestData.handoff_hidden)."""
        request = self.requests.get(req_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_KV:
            return None
        if not request.output_token_ids:
            request.append_output(t0)
        elif t0 != request.output_token_ids[-1]:
            return self.kv_failed(req_id, f"resumed request: prefill handed over token {t0}, the client was "
                                          f"streamed {request.output_token_ids[-1]}")
        request.num_computed_tokens = num_tokens
        handoff = request.handoff
        assert isinstance(handoff, DecodeHandoff)  # only a decode hand-off waits for KV
        handoff.landed, handoff.hidden = True, hidden
        request.status = RequestStatus.WAITING
        # To the front of the queue: it holds memory, so running it soonest frees it soonest.
        self.waiting.remove(request)
        self.waiting.appendleft(request)
        return None

    def kv_failed(self, req_id: str, reason: str, retryable: bool = True) -> RequestUpdate:
        request = self.requests.pop(req_id, None)
        if request is not None and not request.is_finished:
            self._finish(request, FinishReason.ERROR)
        return RequestUpdate(req_id, [], [], FinishReason.ERROR, error=reason, retryable=retryable,
                             transfer_id=request.transfer_id if request is not None else "")

    def _reserve_remote_kv(self) -> None:
        """Reserve blocks for the prompt + t0 (+ lookahead) of requests whose KV comes from a
        prefill instance, oldest first, and have the connector pull it. A preempted request
        (waiting without blocks) goes first, or new reservations would starve it."""
        if any(not r.block_ids and not r.awaits_kv for r in self.waiting):
            return
        for request in self.waiting:
            if not request.awaits_kv or request.status == RequestStatus.WAITING_FOR_KV:
                continue
            if self.blocks.allocate(request, request.num_handoff_tokens + 1 + self.num_lookahead_tokens) is None:
                return
            request.status = RequestStatus.WAITING_FOR_KV
            self.connector.start_load(request)

    # -- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        self._reserve_remote_kv()
        self._step_prefill_tokens = 0
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests in arrival order; returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_uncomputed = request.num_tokens_to_compute - request.num_computed_tokens
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
            self._step_prefill_tokens += min(num_new, num_uncomputed) if num_uncomputed > 1 else 0
            num_drafts = max(0, num_new - num_uncomputed)
            if num_drafts:
                out.num_draft_tokens[request.req_id] = num_drafts
            budget -= num_new
            i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in order, unless memory was just short (they would only be
        preempted). When one does not fit, only requests that already hold their blocks (PD
        handoffs) may still go ahead: they need little more, and waiting on them could deadlock.
        Requests still waiting for their KV are passed over."""
        blocked = False
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs or out.preempted_req_ids:
                break
            if request.awaits_kv or (blocked and not request.block_ids):
                continue
            # Prompt logprobs need every prompt position's logits, which cached blocks do not hold:
            # such a request skips the cache (as vLLM does), and reports 0 cached tokens.
            lookup = request.num_computed_tokens == 0 and not request.computes_prompt_logprobs
            cached = self.blocks.find_cached_prefix(request) if lookup else []
            num_computed = request.num_computed_tokens + len(cached) * self.blocks.block_size
            num_uncomputed = request.num_tokens_to_compute - num_computed
            if not self._joins_step(num_uncomputed):
                continue
            num_new = min(num_uncomputed, budget)
            if self.blocks.allocate(request, num_new + self.num_lookahead_tokens, cached) is None:
                blocked = True
                continue
            self.waiting.remove(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = len(cached) * self.blocks.block_size
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            # A PD hand-off's hidden states go to the slot once: the decode connector ends the
            # hand-off as the request enters it (DecodeConnector.on_scheduled).
            out.new_requests.append(NewRequestData(
                req_id=request.req_id, prompt_len=request.prompt_len, all_token_ids=list(request.all_token_ids),
                num_computed_tokens=num_computed, block_ids=list(request.block_ids),
                sampling_params=request.sampling_params, compute_prompt_logprobs=request.computes_prompt_logprobs,
                handoff_hidden=request.handoff_hidden if num_computed else None, grammar=request.grammar))
            out.num_scheduled_tokens[request.req_id] = num_new
            self._step_prefill_tokens += num_new if num_uncomputed > 1 else 0
            budget -= num_new

    def _joins_step(self, num_uncomputed: int) -> bool:
        """Whether a prompt with this many tokens left to compute starts in this step. A handoff
        (1 token: t0) or the step's first prefill always does; another prefill only while its tokens
        cost less than a step's fixed part (StepCost): a longer one would delay the prompts already
        in the step by more than it saves itself, and finishes no sooner in a step of its own."""
        if num_uncomputed <= 1 or self._step_prefill_tokens == 0:
            return True
        limit = self.step_cost.shared_prefill_tokens()
        return num_uncomputed <= (DEFAULT_SHARED_PREFILL_TOKENS if limit is None
                                  else max(MIN_SHARED_PREFILL_TOKENS, limit))

    def update_from_output(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        for idx, req_id in enumerate(result.req_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            self._account(request, sched, result.sampled_token_ids[idx])
            request.spec_token_ids = list(result.draft_token_ids[idx]) if result.draft_token_ids else []
            self.blocks.cache_full_blocks(request)
            request.prompt_logprobs.extend(result.prompt_logprobs.get(req_id, ()))
            if request.resumed_handoff and request.num_computed_tokens >= request.num_tokens_to_compute:
                # Resumed on P: the KV is complete and the token after it is known, so nothing is
                # sampled or streamed here; the connector hands that token to D with the KV.
                self._finish(request, FinishReason.HANDED_OFF)
                continue
            update = self._append_tokens(request, result.sampled_token_ids[idx],
                                         result.logprobs[idx] if result.logprobs else [])
            if update is not None:
                updates.append(update)
        for req_id in list(self.requests):
            if self.requests[req_id].is_finished:
                del self.requests[req_id]
        return updates

    # -- helpers ---------------------------------------------------------------------------

    def _account(self, request: Request, sched: SchedulerOutput, sampled: list[int]) -> None:
        """num_computed_tokens after a step (I4: only the scheduler changes it)."""
        req_id = request.req_id
        request.num_computed_tokens += sched.num_scheduled_tokens[req_id]
        if sampled:
            # Verified 1 + k positions, kept len(sampled) tokens: the KV of the rejected
            # drafts is garbage and must be recomputed.
            num_drafts = sched.num_draft_tokens.get(req_id, 0)
            request.num_computed_tokens -= num_drafts + 1 - len(sampled)
            if num_drafts:
                self.spec_stats.record(num_drafts, len(sampled) - 1)

    def _append_tokens(self, request: Request, sampled: list[int],
                       logprobs: list[TokenLogprobs]) -> RequestUpdate | None:
        """Append a step's tokens up to the first stop; the update to send, if any."""
        new_tokens: list[int] = []
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
        if not (new_tokens or finish):
            return None
        first = len(request.output_token_ids) - len(new_tokens)
        queue_time = None
        if first == 0 and request.first_scheduled_time is not None:
            queue_time = request.first_scheduled_time - request.arrival_time
        reason = None if finish == FinishReason.HANDED_OFF else finish
        update = RequestUpdate(request.req_id, new_tokens, logprobs[: len(new_tokens)], reason, first, queue_time,
                               transfer_id=request.transfer_id)
        if first == 0 and new_tokens:
            update.num_cached_tokens = request.num_cached_tokens
            if request.sampling_params.prompt_logprobs is not None:
                update.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, []  # sent: not kept
        return update

    def _preempt(self, request: Request) -> None:
        self.blocks.free_request(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        if request.computes_prompt_logprobs:
            request.prompt_logprobs = []  # the prefill starts over, and computes them again
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
            self._finished_ids.add(request.req_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.connector.request_finished(request):
            request.block_ids = []  # the connector owns them now (prefill: until the transfer is acked)
        else:
            self.blocks.free_request(request)
