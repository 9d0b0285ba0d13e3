"""The scheduler's view of one request."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from scheduler.output import TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
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
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks computed so far
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify next step
    finish_reason: str | None = None
    num_preemptions: int = 0
    # Prefill role: stop after the first sampled token (t0) and keep the KV blocks for the transfer.
    prefill_only: bool = False
    first_scheduled_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)

    def check_stop(self, max_model_len: int) -> str | None:
        """Finish reason after the last appended token, or None to keep going.

        "prefilled" ends a prefill-only request once t0 is sampled and nothing else stops it.
        """
        params = self.sampling_params
        n = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        if n >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return "stop"
            if last in params.stop_token_ids:
                return "stop"
        if n >= params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return "prefilled" if self.prefill_only else None
