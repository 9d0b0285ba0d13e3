"""The scheduler's view of one request, and its side of a PD hand-off. Plain data plus the stop
check; imports only engine.types."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.types import FinishReason, SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    import torch


class RequestStatus(enum.StrEnum):
    WAITING = "waiting"                # waiting for a slot (and blocks)
    WAITING_FOR_KV = "waiting_for_kv"  # decode role: blocks reserved, the prompt's KV is on its way from P
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Logprobs of prompt tokens 1.. (token 0 has none), gathered over the prefill's chunks; sent with t0.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache at first admission
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks computed so far
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify next step
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    # PD: the id the front end gave this attempt (a retry gets a new one). Every output carries it,
    # also those of a request served whole here, so it is the request's, not only its hand-off's.
    transfer_id: str = ""
    # PD: this engine's side of the request's hand-off, made by the engine's KV connector when the
    # request arrives (None: the request is served whole here).
    handoff: PrefillHandoff | DecodeHandoff | None = None
    # The compiled grammar of sampling_params.grammar (an xgrammar CompiledGrammar), compiled before
    # the request was queued: admission to a slot, inside a step, must not compile.
    grammar: Any = None

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def computes_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and not yet delivered (they go out with the first token)."""
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def remote_decode(self) -> bool:
        """Prefill role: the request stops after its first sampled token (t0); a decode instance
        generates the rest."""
        return isinstance(self.handoff, PrefillHandoff)

    @property
    def awaits_kv(self) -> bool:
        """Decode role: the prompt's KV comes from a prefill instance and has not landed yet."""
        return isinstance(self.handoff, DecodeHandoff) and not self.handoff.landed

    @property
    def handoff_hidden(self) -> torch.Tensor | None:
        """Decode role: the hidden states P sent with the prompt's KV, for the MTP drafter."""
        return self.handoff.hidden if isinstance(self.handoff, DecodeHandoff) else None

    @property
    def num_handoff_tokens(self) -> int:
        """PD: the positions whose KV a handoff carries. A fresh request hands over its prompt (t0,
        sampled on P, follows it); a resumed one -- outputs already streamed to the client, its
        engine died (failover) -- hands over all but its last output, which seeds D's slot."""
        return self.num_tokens - 1 if self.output_token_ids else self.prompt_len

    @property
    def resumed_handoff(self) -> bool:
        """Prefill role, resumed request: P computes the KV of all but the last streamed token and
        hands that token to D as it is. Sampling one here would stream a token twice (or a new one)."""
        return self.remote_decode and bool(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """The tokens this engine computes for the request before it samples (or hands off)."""
        return self.num_handoff_tokens if self.resumed_handoff else self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)

    def check_stop(self, max_model_len: int) -> FinishReason | None:
        """Finish reason after the last appended token, or None to keep going.

        HANDED_OFF ends a prefill-role request once t0 is sampled and nothing else stops it.
        """
        params = self.sampling_params
        n = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        if n >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return FinishReason.STOP
            if last in params.stop_token_ids:
                return FinishReason.STOP
        if n >= params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return FinishReason.HANDED_OFF if self.remote_decode else None


# The two sides of one P->D hand-off (docs/architecture.md, the hand-off). Each engine's KV connector
# keeps its side by request id for as long as the transfer concerns it, and the request points at
# it; they are declared here, beside Request, so that the request and the scheduler can read them.


@dataclass(eq=False)
class PrefillHandoff:
    """Prefill role: from the request's arrival until its blocks pass to the KV sender's lease (or
    the request ends here). Its presence makes the request stop after t0 (`Request.remote_decode`)."""

    request: Request = field(repr=False)
    # The target's hidden states of the prompt's last positions so far (for D's MTP drafter), in
    # order, and the position after them.
    hidden: list[torch.Tensor] = field(default_factory=list)
    hidden_end: int = 0
    prefill_done_time: float = 0.0  # wall clock when the forward of the prompt's last KV layer was over (0: not yet)

    def add_hidden(self, start: int, rows: torch.Tensor) -> None:
        """The hidden states of positions [start, start + len(rows)), in order."""
        if start != self.hidden_end:  # not the next positions: the prompt is computed again (preempted)
            self.hidden = []
        self.hidden.append(rows)
        self.hidden_end = start + len(rows)


@dataclass(eq=False)
class DecodeHandoff:
    """Decode role: from the request's arrival until it enters a slot (or ends)."""

    request: Request = field(repr=False)
    kv_endpoint: str  # where the prefill instance serves the prompt's KV
    # Blocks must be reserved by then (the KV receiver's clock), or the request fails with a
    # retryable error; None: no deadline (the blocks are reserved, or none was set).
    reserve_by: float | None = None
    landed: bool = False  # the KV is in the request's blocks (Scheduler.kv_loaded)
    hidden: torch.Tensor | None = None  # came with the KV: the MTP drafter's seed (NewRequestData)
    prefill_done_time: float = 0.0  # P's wall clock at its last KV layer's forward (0: unknown)
