"""What every drafter returns and offers: `Drafts` and the `Drafter` protocol.

A drafter runs after the step's tokens are written back and returns, per batch row, the drafts to
verify next step ([] for rows that did not sample, and for every row when the policy chose 0),
with whatever the verifier and the policy need to know about how they were made.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from worker.input_batch import InputBatch
from worker.kv_tap import StepTap
from worker.sample.sampler import SamplingMetadata

# (slots of the drafting rows, draft index j) -> settings of output position n_out + j of each
# row, with that position's keyed generator; None when every row is greedy (PositionMetadata.for_draft).
DraftMetadataFn = Callable[[np.ndarray, int], SamplingMetadata | None]


class DraftMode(enum.StrEnum):
    GREEDY = "greedy"    # argmax of the draft logits, whatever the request's temperature
    COUPLED = "coupled"  # random rows: drawn from the draft distribution with the verifier's noise
    # As COUPLED, except that unseeded plain-temperature rows (RequestStates.plain_random) draw their
    # drafts from the draft distribution q with fresh noise, and q goes to the standard rejection
    # sampler: it accepts with probability sum_v min(p_v, q_v), the most any coupling can, where
    # the coupled race agrees less often (benchmarks/bench_draft_sampling.py). Seeded rows stay
    # coupled: their output must not depend on how many drafts were verified when.
    INDEPENDENT = "independent"


@dataclass
class Drafts:
    """One propose() call's result."""

    token_ids: list[list[int]]            # per batch row
    k: int = 0                            # drafts asked of each drafting row (the policy's choice)
    # The distributions q [rows, k, draft vocab] of drafts drawn independently, and the batch rows
    # they belong to (None when no row drew independently: the verifier then matches).
    probs: torch.Tensor | None = None
    probs_rows: np.ndarray | None = None
    flushed: bool = False                 # the drafter ran its layer for rows that did not draft

    @classmethod
    def none(cls, batch: InputBatch, k: int = 0) -> Drafts:
        return cls([[] for _ in batch.req_ids], k)

    def probs_by_row(self) -> dict[int, torch.Tensor]:
        """Batch row -> the distributions its drafts were drawn from (rows that drew independently)."""
        if self.probs is None:
            return {}
        return {row: self.probs[i] for i, row in enumerate(self.probs_rows.tolist())}


class Drafter(Protocol):
    # Whether the drafter writes KV of its own (the MTP layers' paged cache) and so reports the
    # step's last KV layer to a tap itself; else the runner does once the target's forward is done.
    writes_kv: bool

    def propose(self, batch: InputBatch, hidden: torch.Tensor, accepted: list[list[int]], k: int,
                draft_meta: DraftMetadataFn, kv_tap: StepTap | None) -> Drafts:
        """Up to k drafts per sampling row; `kv_tap`: this step's tapped prompt rows (a prefill
        engine in PD), whose KV the drafter reports too."""
        ...

    def seed_from_handoff(self, slot: int, num_computed: int, hidden: torch.Tensor) -> None:
        """A request admitted with hidden states handed over by a prefill engine (PD)."""
        ...

    def backfill(self, slots: np.ndarray) -> int:
        """Positions of these slots whose drafter KV the next drafting step must compute first."""
        ...
