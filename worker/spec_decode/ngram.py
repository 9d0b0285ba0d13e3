"""The n-gram drafter: prompt lookup, the weight-free fallback (`--speculative-method ngram`)."""
from __future__ import annotations

import numpy as np
import torch

from worker.input_batch import InputBatch
from worker.kv_tap import StepTap
from worker.spec_decode.drafter import DraftMetadataFn, Drafts
from worker.states import RequestStates
from worker.structured import GrammarStates


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens, propose what followed.
    Its drafts are deterministic: the verifier matches them."""

    def __init__(self, states: RequestStates, num_tokens: int, max_n: int = 4, min_n: int = 1,
                 grammar: GrammarStates | None = None) -> None:
        self.states, self.k, self.max_n, self.min_n = states, num_tokens, max_n, min_n
        self.grammar = grammar  # structured output: drafts cut where the grammar refuses one
        self.writes_kv = False

    def propose(self, batch: InputBatch, hidden: torch.Tensor, accepted: list[list[int]], k: int,
                draft_meta: DraftMetadataFn, kv_tap: StepTap | None = None) -> Drafts:
        drafts = Drafts.none(batch, k)
        if k == 0:
            return drafts
        for row in np.nonzero(batch.samples)[0].tolist():
            slot = int(batch.slots[row])
            tokens = self.states.all_token_ids[slot, : self.states.total_len_np[slot]].tolist()
            proposed = self.lookup(tokens)[:k]
            if self.grammar is not None:
                proposed = proposed[: self.grammar.valid_prefix(slot, proposed)]
            drafts.token_ids[row] = proposed
        return drafts

    def seed_from_handoff(self, slot: int, num_computed: int, hidden: torch.Tensor) -> None:
        """Nothing to seed: prompt lookup reads the tokens alone."""

    def backfill(self, slots: np.ndarray) -> int:
        return 0

    def lookup(self, tokens: list[int]) -> list[int]:
        arr = np.asarray(tokens)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            tail = arr[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.nonzero((windows == tail).all(axis=1))[0]
            if len(hits):
                start = int(hits[-1]) + n
                return arr[start : start + self.k].tolist()
        return []
