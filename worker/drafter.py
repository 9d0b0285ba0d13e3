"""Draft proposers for speculative decoding: the MTP layer (recursive) and n-gram prompt lookup.

Both run after the step's tokens are written back, and return per batch row the drafts to
verify next step ([] for rows that did not sample).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker import kernels
from worker.attention import AttentionContext, StepLayout
from worker.models.llama import CausalLM
from worker.states import RequestStates


@dataclass
class StepBatch:
    """Host-side view of the scheduled batch (arrays indexed by batch row)."""

    req_ids: list[str]
    slots: np.ndarray
    layout: StepLayout
    num_drafts: np.ndarray     # drafts verified this step
    is_prefilling: np.ndarray
    samples: np.ndarray        # rows that produce tokens this step

    def last_valid_index(self, num_accepted: np.ndarray) -> np.ndarray:
        """Flat index of each row's last position whose KV is now valid (rejected drafts excluded)."""
        ends = self.layout.query_start_loc[1:]
        return ends - 1 - (self.num_drafts - np.maximum(num_accepted - 1, 0))


class MTPDrafter:
    def __init__(self, model: CausalLM, states: RequestStates, kv_views, block_size: int, num_tokens: int,
                 device: torch.device) -> None:
        self.model, self.states, self.kv_views = model, states, kv_views
        self.block_size, self.k, self.device = block_size, num_tokens, device

    def run_over_step(self, batch: StepBatch, hidden: torch.Tensor, ctx: AttentionContext,
                      accepted: list[list[int]]) -> torch.Tensor:
        """Run the MTP layer over every position of the step so its KV matches the target's.

        Position i pairs h_i with x_{i+1}. In a verify row that is the i-th kept token (accepted
        drafts, then the bonus); positions past those get a placeholder, and their KV is
        recomputed when the next step verifies them. A prefill chunk reads x_{i+1} from
        all_token_ids after write-back (the next prompt token, or the token just sampled).
        """
        positions = batch.layout.positions()
        qsl = batch.layout.query_start_loc
        if batch.is_prefilling.any():
            next_ids = torch.empty(hidden.shape[0], dtype=torch.int32, device=self.device)
            everyone = torch.ones(len(batch.slots), dtype=torch.bool, device=self.device)
            kernels.gather_prefill_tokens(next_ids, self.states.all_token_ids, torch.from_numpy(batch.slots).to(self.device),
                                          torch.from_numpy(qsl).to(self.device),
                                          torch.from_numpy(batch.layout.num_computed + 1).to(self.device), everyone)
        else:  # decode-only: everything needed is already on the host
            host = np.zeros(hidden.shape[0], dtype=np.int32)
            for row, toks in enumerate(accepted):
                host[qsl[row] : qsl[row] + len(toks)] = toks
            next_ids = torch.from_numpy(host).to(self.device)
        return self.model.mtp_forward(0, hidden, next_ids, ctx.positions, ctx, has_position0=bool((positions == 0).any()))

    def propose(self, batch: StepBatch, hidden: torch.Tensor, ctx: AttentionContext,
                accepted: list[list[int]]) -> list[list[int]]:
        mtp_hidden = self.run_over_step(batch, hidden, ctx, accepted)
        rows = np.nonzero(batch.samples)[0]
        drafts: list[list[int]] = [[] for _ in batch.req_ids]
        if not len(rows):
            return drafts
        num_accepted = np.array([len(a) for a in accepted], dtype=np.int64)
        last = batch.last_valid_index(num_accepted)[rows]
        h = mtp_hidden[torch.from_numpy(last).to(self.device)]
        token = self.model.compute_draft_logits(h).argmax(-1)
        proposed = [token]
        # Drafts 2..k: apply the layer on its own hidden state, one position further each time.
        # These KV writes land in lookahead slots that the next verify step overwrites.
        block_tables = batch.layout.block_tables[rows]
        first_pos = batch.layout.positions()[last]
        ones = np.ones(len(rows), dtype=np.int32)
        for i in range(1, self.k):
            layout = StepLayout(block_tables, (first_pos + i).astype(np.int32), ones)
            step_ctx = AttentionContext(self.kv_views, layout, self.block_size, self.device)
            h = self.model.mtp_forward(0, h, token, step_ctx.positions, step_ctx, has_position0=False)
            token = self.model.compute_draft_logits(h).argmax(-1)
            proposed.append(token)
        table = torch.stack(proposed, dim=1).tolist()
        for row, d in zip(rows.tolist(), table):
            drafts[row] = d
        return drafts


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens, propose what followed."""

    def __init__(self, states: RequestStates, num_tokens: int, max_n: int = 4, min_n: int = 1) -> None:
        self.states, self.k, self.max_n, self.min_n = states, num_tokens, max_n, min_n

    def propose(self, batch: StepBatch, hidden: torch.Tensor, ctx: AttentionContext,
                accepted: list[list[int]]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in batch.req_ids]
        for row in np.nonzero(batch.samples)[0].tolist():
            slot = int(batch.slots[row])
            tokens = self.states.all_token_ids[slot, : self.states.total_len_np[slot]].tolist()
            drafts[row] = self.lookup(tokens)
        return drafts

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
