"""The scheduler's view of one request. Plain data plus the stop check; imports only engine.types."""
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
    # PD hand-off, set by the engine's KV connector when the request arrives:
    # prefill role: stop after the first sampled token (t0) and hand the KV over to a decode instance.
    remote_decode: bool = False
    # decode role: the KV endpoint of the prefill instance the prompt's KV comes from, until it has come.
    kv_source: str = ""
    # prefill and decode roles: the id the front end gave this attempt's KV transfer (a retry gets a new one).
    kv_transfer_id: str = ""
    # decode role: the target's hidden states of the prompt's last positions that came with its KV
    # (for the MTP drafter, which has no KV of its own for them), until the request enters a slot.
    handoff_hidden: torch.Tensor | None = None
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
