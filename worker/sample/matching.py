"""Verification by matching: a verified draft is kept while it equals the target's own sample
at its position (tests/reference_rejection_sampler.py explains why that is exact)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class RejectionOutput:
    """Result of verifying one batch of drafts."""

    # Per request: the accepted drafts followed by one bonus/recovered token (length 1..k_b+1).
    accepted_token_ids: list[list[int]]
    # Per request: how many drafts were accepted (0..k_b); the scheduler rolls back k_b minus this.
    num_accepted_drafts: list[int]


def accept_matching_prefix(target_token_ids: Sequence[int], num_draft_tokens: Sequence[int],
                           draft_token_ids: Sequence[Sequence[int]]) -> RejectionOutput:
    """Verification by sampling: keep the drafts that equal the target's own samples, then one more.

    ``target_token_ids`` holds, per request in order, the ``1 + k_b`` tokens the target
    sampler drew at the verified positions (argmax for greedy rows, a draw with the
    position's keyed noise for random rows). Draft ``j`` is accepted while it equals the
    target token at position ``j``; the first mismatch (or the bonus position) contributes
    the target's token. Each emitted token is the target's sample at its position given the
    accepted prefix, so the output is distributed exactly as without speculation -- and for
    a fixed noise it is the very same sequence.
    """
    accepted, num_accepted = [], []
    start = 0
    for k, drafts in zip(num_draft_tokens, draft_token_ids):
        m = 0
        while m < k and drafts[m] == target_token_ids[start + m]:
            m += 1
        accepted.append(list(drafts[:m]) + [int(target_token_ids[start + m])])
        num_accepted.append(m)
        start += 1 + k
    return RejectionOutput(accepted_token_ids=accepted, num_accepted_drafts=num_accepted)
