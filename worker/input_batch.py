"""One step's batch as the worker sees it, described once.

`InputBatch` is what the runner builds from a SchedulerOutput (which rows, which slots, how many
drafts, who samples); `StepLayout`, inside it, is the part attention needs (block tables, tokens
cached before the step and computed in it), which the MTP drafter also builds on its own for its
recursive passes. Host-side numpy; the device tensors are made from these where they are needed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class StepLayout:
    """The part of a step's batch that attention needs (arrays indexed by batch row b < B); the
    drafter builds its own for the recursive MTP passes."""

    block_tables: np.ndarray     # [B, max_blocks] int32, physical block ids of each row
    num_computed: np.ndarray     # [B] tokens already in the cache before this step
    query_lens: np.ndarray       # [B] tokens computed this step

    def __post_init__(self) -> None:
        self.query_start_loc = np.zeros(len(self.query_lens) + 1, dtype=np.int32)
        np.cumsum(self.query_lens, out=self.query_start_loc[1:])
        self.seq_lens = self.num_computed + self.query_lens
        if int(self.query_lens.max()) == 1:  # all single-token rows (decode): one position each
            self._positions = self.num_computed.astype(np.int64)
        else:
            row = np.repeat(np.arange(len(self.query_lens)), self.query_lens)
            self._positions = (self.num_computed[row] + (np.arange(int(self.query_start_loc[-1]))
                                                         - self.query_start_loc[:-1][row])).astype(np.int64)

    def positions(self) -> np.ndarray:
        return self._positions


@dataclass
class InputBatch:
    """The runner's view of one step's batch (every array indexed by batch row b < B)."""

    req_ids: list[str]         # [B]
    slots: np.ndarray          # [B] int32, the request-state slot of each row
    layout: StepLayout         # what attention needs: block tables, cached and new token counts
    num_drafts: np.ndarray     # [B] int32, drafts verified this step
    is_prefilling: np.ndarray  # [B] bool, from num_computed vs prefill_len (I5)
    samples: np.ndarray        # [B] bool, rows that produce tokens this step

    def __post_init__(self) -> None:
        # Every row decodes: a finished prompt's row that samples (so it verifies its drafts, if any).
        self._decodes = not self.is_prefilling.any() and bool(self.samples.all())
        # A steady step: every row decodes one token (so verifies no drafts). Most steps under load
        # are; asked several times a step.
        self.steady = self._decodes and len(self.slots) == int(self.layout.query_start_loc[-1])

    def steady_with(self, k: int) -> bool:
        """Whether every row decodes and verified exactly k drafts (k=0: a steady step): the steps
        whose cost the speculation policy learns from."""
        return self.steady if not k else self._decodes and bool((self.num_drafts == k).all())

    def num_valid(self, accepted: list[list[int]]) -> np.ndarray:
        """Per row, the leading positions of this step whose KV is now valid: all of a prefill
        chunk; for a verify row the kept ones (accepted drafts and the position of the bonus)."""
        kept = np.array([len(a) for a in accepted], dtype=np.int32)
        rejected = self.num_drafts - np.maximum(kept - 1, 0)
        return np.where(self.samples, self.layout.query_lens - rejected, self.layout.query_lens).astype(np.int32)
