"""Speculation for one runner: the policy picks k, the drafter proposes, the drafts are kept for
the next step's verify, and the step's outcome and cost feed the policy.

Everything the policy learns from comes from two returned values: the verifier's `StepTokens`
(how many drafts each row kept, whether the step sampled) and the drafter's `Drafts` (how many
were asked for, whether the drafter flushed its stash).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from worker.input_batch import InputBatch
from worker.kv_tap import StepTap
from worker.sample.verifier import StepTokens, check_in_vocab
from worker.spec_decode.drafter import Drafter, DraftMetadataFn, Drafts
from worker.spec_decode.policy import SpecPolicy
from worker.states import RequestStates

# Gaps between steps longer than this are the engine idling, not its per-step overhead.
MAX_OVERHEAD_SECONDS = 0.05


class Speculator:
    def __init__(self, drafter: Drafter, policy: SpecPolicy, states: RequestStates, vocab_size: int) -> None:
        self.drafter, self.policy, self.states, self.vocab_size = drafter, policy, states, vocab_size
        self._last_step_end: float | None = None

    def propose(self, batch: InputBatch, hidden: torch.Tensor, tokens: StepTokens, draft_meta: DraftMetadataFn,
                kv_tap: StepTap | None, proposes_drafts: bool) -> Drafts:
        """The drafts for the next step (stored in the slots, and returned). `proposes_drafts`: False
        on a prefill engine in PD, whose requests leave after t0: its steps neither consult the
        policy nor count in the chosen-k metric (under load they would skew it toward k=0)."""
        k = self._choose_num_drafts(batch, tokens) if proposes_drafts else 0
        drafts = self.drafter.propose(batch, hidden, tokens.accepted, k, draft_meta, kv_tap)
        check_in_vocab(drafts.token_ids, self.vocab_size, "draft")
        if k or not batch.steady:  # else nothing was verified or proposed: no buffer to update
            self._store(batch, drafts)
        return drafts

    def observe(self, batch: InputBatch, tokens: StepTokens, drafts: Drafts, start: float) -> None:
        """Feed the cost model: steady decode steps only (every row verified k drafts and proposed
        k; no prefill chunk, no stash flush), plus the engine's time between steps."""
        end = time.perf_counter()
        if self._last_step_end is not None and start - self._last_step_end < MAX_OVERHEAD_SECONDS:
            self.policy.record_overhead(start - self._last_step_end)
        self._last_step_end = end
        if batch.steady_with(drafts.k) and not drafts.flushed:
            self.policy.record_step(len(batch.slots), drafts.k, end - start, tokens.sampled)

    def _choose_num_drafts(self, batch: InputBatch, tokens: StepTokens) -> int:
        if not batch.steady:
            verified = np.nonzero(batch.samples & (batch.num_drafts > 0))[0]
            if len(verified):
                self.policy.record_acceptance(batch.num_drafts[verified].tolist(),
                                              [len(tokens.accepted[r]) - 1 for r in verified.tolist()])
        rows = len(batch.slots) if batch.steady else int(batch.samples.sum())
        if self.policy.holds_k0(rows, tokens.sampled):
            return 0
        return self.policy.choose(rows, self.drafter.backfill(batch.slots), tokens.sampled)

    def _store(self, batch: InputBatch, drafts: Drafts) -> None:
        st = self.states
        probs = drafts.probs_by_row()
        for row in np.nonzero(batch.samples)[0].tolist():
            proposed = drafts.token_ids[row]
            st.store_drafts(int(batch.slots[row]), proposed, probs.get(row) if proposed else None)
        if not st.drafts_shared:
            idx = torch.from_numpy(batch.slots).to(st.device)
            st.draft_tokens[idx] = torch.from_numpy(st.draft_tokens_np[batch.slots]).to(st.device)
