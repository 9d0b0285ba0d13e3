"""Per-request state in fixed, reused slots (docs/architecture.md, request-state invariants), as
explicit arrays indexed by slot.

Host arrays (numpy) hold what the CPU needs to build a step; device tensors hold what kernels
read. Slots are handed out LIFO so that a stale-state bug shows at once.
"""
from __future__ import annotations

import random

import numpy as np
import torch

from engine.types import SamplingParams
from scheduler.output import CachedRequestData, NewRequestData
from worker.sample.sampler import GREEDY_TEMPERATURE_EPS


class RequestStates:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_req: int, max_draft_tokens: int,
                 device: torch.device, noise_seed: int = 0) -> None:
        s, i32 = max_num_seqs, np.int32
        self.max_num_seqs = s
        self.device = device
        self.free_slots: list[int] = list(range(s - 1, -1, -1))
        self.req_id_to_slot: dict[str, int] = {}
        self.slot_req_id: list[str | None] = [None] * s

        # Host side.
        self.prompt_len = np.zeros(s, i32)
        self.prefill_len = np.zeros(s, i32)          # tokens fed from all_token_ids before decode starts
        self.total_len_np = np.zeros(s, i32)          # mirror of `total_len`
        # Mirror of the scheduler's value (I4: overwritten every step, never incremented).
        self.num_computed_tokens_np = np.zeros(s, i32)
        self.num_computed_prefill_tokens = np.zeros(s, i32)
        self.num_draft_tokens = np.zeros(s, i32)      # valid entries of draft_tokens[slot]
        self.draft_tokens_np = np.full((s, max(1, max_draft_tokens)), -1, i32)  # host copy of draft_tokens
        # Whether draft_probs[slot] holds the distributions q the slot's drafts were drawn from (the
        # rejection sampler then verifies them); else they are verified by matching (coupled, greedy).
        self.draft_has_probs = np.zeros(s, bool)
        self.draft_probs: torch.Tensor | None = None  # [slots, drafts, draft vocab], allocated on first use
        self.block_table = np.zeros((s, max_blocks_per_req), i32)
        self.num_blocks = np.zeros(s, i32)
        self.sampling_params: list[SamplingParams | None] = [None] * s
        self.computes_prompt_logprobs = np.zeros(s, bool)  # the scheduler's per-admission choice
        # Sampling is the argmax of the raw logits (greedy; no penalties, grammar or logprobs), once
        # the output is min_tokens long: the runner's fast path for whole batches of such rows.
        self.plain_greedy = np.zeros(s, bool)
        self.min_tokens = np.zeros(s, i32)
        # Unseeded plain-temperature sampling (no top-k/p, min-p, penalties or grammar): the rows whose
        # drafts may be drawn independently from the drafter's own distribution (DraftMode.INDEPENDENT).
        self.plain_random = np.zeros(s, bool)
        # Per slot: the seed that keys the randomness of each output position (docs/architecture.md,
        # speculative decoding): the request's own, or for an unseeded request one drawn at admission
        # from this instance's stream (`noise_seed` differs between engine instances, so P and D never share noise).
        self.seeds: list[int] = [0] * s
        self._unseeded = random.Random(noise_seed)
        # MTP layer positions still owed KV (decode steps taken without drafting; worker/spec_decode/mtp.py).
        self.mtp_pending = np.zeros(s, i32)

        # Device side.
        self.all_token_ids = torch.zeros(s, max_model_len, dtype=torch.int32, device=device)
        self.total_len = torch.zeros(s, dtype=torch.int32, device=device)
        self.num_computed_tokens = torch.zeros(s, dtype=torch.int32, device=device)
        self.last_sampled_tokens = torch.zeros(s, dtype=torch.int32, device=device)
        # -1 marks "no draft" (I3); at least one column so kernels never see a 0-sized axis. On a CPU
        # it is draft_tokens_np's own memory: nothing to copy after each step's drafts are stored.
        self.drafts_shared = device.type == "cpu"
        self.draft_tokens = (torch.from_numpy(self.draft_tokens_np) if self.drafts_shared else
                             torch.full((s, max(1, max_draft_tokens)), -1, dtype=torch.int32, device=device))

    # -- admission / removal -------------------------------------------------------------

    def add_request(self, new: NewRequestData) -> int:
        if not self.free_slots:
            raise RuntimeError("no free request slot: the scheduler admitted more than max_num_seqs requests")
        slot = self.free_slots.pop()
        self.req_id_to_slot[new.req_id] = slot
        self.slot_req_id[slot] = new.req_id

        tokens = new.all_token_ids
        total, computed = len(tokens), new.num_computed_tokens
        # A request with every token but the last already in the KV cache (a PD handoff, or a
        # resumed request whose prefix is cached) starts in decode and feeds last_sampled next.
        prefill_len = computed if 0 < computed == total - 1 else total
        self.prompt_len[slot] = new.prompt_len
        self.prefill_len[slot] = prefill_len
        self.total_len_np[slot] = total
        self.total_len[slot : slot + 1] = total
        self.all_token_ids[slot, :total] = torch.tensor(tokens, dtype=torch.int32).to(self.device, non_blocking=True)
        self.num_computed_tokens_np[slot] = computed
        self.num_computed_prefill_tokens[slot] = min(computed, prefill_len)
        self.num_computed_tokens[slot : slot + 1] = computed

        # I2: reset everything that can be read before it is written, on every admission.
        self.reset_drafts(slot)
        self.mtp_pending[slot] = 0  # whatever is computed on admission came with its MTP KV (prefill, P)
        if computed > 0:
            self.seed_last_sampled(slot, tokens[total - 1])

        self.num_blocks[slot] = 0
        self.block_table[slot] = 0
        self.append_blocks(slot, new.block_ids)

        params = new.sampling_params
        self.sampling_params[slot] = params
        self.computes_prompt_logprobs[slot] = new.compute_prompt_logprobs
        self.plain_greedy[slot] = (params.temperature < GREEDY_TEMPERATURE_EPS and not params.needs_penalties
                                   and params.grammar is None and params.logprobs is None)
        self.min_tokens[slot] = params.min_tokens
        self.plain_random[slot] = (params.temperature >= GREEDY_TEMPERATURE_EPS and params.seed is None
                                   and not params.needs_penalties and params.grammar is None
                                   and params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0)
        self.seeds[slot] = params.seed if params.seed is not None else self._unseeded.getrandbits(63)
        return slot

    def reset_drafts(self, slot: int) -> None:
        self.draft_tokens_np[slot] = -1
        if not self.drafts_shared:
            self.draft_tokens[slot].fill_(-1)
        self.num_draft_tokens[slot] = 0
        self.draft_has_probs[slot] = False

    def store_drafts(self, slot: int, drafts: list[int], probs: torch.Tensor | None = None) -> None:
        """Drafts to verify next step; unused columns stay -1 (placeholders, I3). `probs` [len(drafts),
        draft vocab]: the distribution each was drawn from, when drawn independently."""
        row = np.full(self.draft_tokens_np.shape[1], -1, np.int32)
        row[: len(drafts)] = drafts
        self.draft_tokens_np[slot] = row
        self.num_draft_tokens[slot] = len(drafts)
        self.draft_has_probs[slot] = probs is not None
        if probs is not None:
            if self.draft_probs is None or self.draft_probs.shape[2] != probs.shape[1]:
                self.draft_probs = torch.empty(self.max_num_seqs, self.draft_tokens_np.shape[1], probs.shape[1],
                                               device=self.device)
            self.draft_probs[slot, : len(drafts)] = probs

    def seed_last_sampled(self, slot: int, token: int) -> None:
        # Slice assignment from a Python int is a fill: no host/device sync on admission.
        self.last_sampled_tokens[slot : slot + 1] = token

    def update_request(self, cached: CachedRequestData) -> None:
        slot = self.req_id_to_slot[cached.req_id]
        self.num_computed_tokens_np[slot] = cached.num_computed_tokens  # I4: the scheduler's value wins
        self.append_blocks(slot, cached.new_block_ids)

    def refresh_computed_prefill(self) -> None:
        np.minimum(self.num_computed_tokens_np, self.prefill_len, out=self.num_computed_prefill_tokens)

    def append_blocks(self, slot: int, block_ids: list[int]) -> None:
        n, k = int(self.num_blocks[slot]), len(block_ids)
        if k:
            self.block_table[slot, n : n + k] = block_ids
            self.num_blocks[slot] = n + k

    def remove_request(self, req_id: str) -> None:
        slot = self.req_id_to_slot.pop(req_id, None)
        if slot is None:
            return
        self.slot_req_id[slot] = None
        self.sampling_params[slot] = None
        self.free_slots.append(slot)  # LIFO: the next admission reuses this slot

    def is_prefilling(self, slots: np.ndarray) -> np.ndarray:
        """I5: per request, from num_computed vs prefill_len; never from the query length."""
        return self.num_computed_prefill_tokens[slots] < self.prefill_len[slots]
