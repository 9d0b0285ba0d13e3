"""The scheduler <-> worker contract for one step (docs/architecture.md, request-state invariants).
Plain data, nothing else."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.types import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    import torch


@dataclass
class NewRequestData:
    """A request entering a slot this step (fresh, resumed after preemption, or a PD handoff)."""

    req_id: str
    prompt_len: int
    all_token_ids: list[int]      # prompt (+ outputs for a resumed request, + t0 for a PD handoff)
    num_computed_tokens: int
    block_ids: list[int]
    sampling_params: SamplingParams
    compute_prompt_logprobs: bool = False  # log_softmax over the prompt positions this slot prefills
    # A PD handoff from a prefill engine that did not run the MTP layer: the target's hidden states
    # of the last positions before num_computed_tokens, which the MTP drafter runs it over instead.
    handoff_hidden: torch.Tensor | None = None
    grammar: Any = None  # Request.grammar: sampling_params.grammar, compiled


@dataclass
class CachedRequestData:
    """A request already in a slot. `num_computed_tokens` is authoritative (I4)."""

    req_id: str
    num_computed_tokens: int
    new_block_ids: list[int]


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # Insertion order is the batch order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner: no tokens to compute and no slot to free."""
        return not (self.num_scheduled_tokens or self.finished_req_ids or self.preempted_req_ids)


@dataclass
class RunnerOutput:
    req_ids: list[str]
    sampled_token_ids: list[list[int]]        # per request: accepted tokens ([] for a mid-prefill chunk)
    draft_token_ids: list[list[int]]          # per request: drafts proposed for the next step
    logprobs: list[list[TokenLogprobs]] | None = None
    # Per request that asked for them: logprobs of the prompt tokens whose predicting position ran
    # this step (prompt token i's comes from position i - 1), in order.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
