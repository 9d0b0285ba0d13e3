"""The MTP drafter: the target's multi-token-prediction layer, run recursively to draft."""
from __future__ import annotations

import collections

import numpy as np
import torch

from worker import invariants, kernels
from worker.attention import AttentionContext, CacheWriter, default_backend
from worker.input_batch import InputBatch, StepLayout
from worker.kv_tap import StepTap
from worker.models.llama import CausalLM
from worker.sample.draft import coupled_chain_args, independent_chain_args, pick_draft_tokens
from worker.sample.sampler import Sampler
from worker.spec_decode.drafter import DraftMetadataFn, DraftMode, Drafts
from worker.states import RequestStates
from worker.structured import DraftWalk, GrammarStates


class MTPDrafter:
    """The MTP layer keeps its own KV, which must cover every position before the next draft.

    Drafting rows and prefill chunks run the layer over this step's valid positions. A decode
    row that does not draft (the policy chose k=0) skips the layer: its target hidden states are
    stashed instead, and the layer runs over them (backfill) the next time the row drafts, in the
    same pass. So a k=0 step costs nothing extra, and a request that never drafts again never pays
    for the layer. A stash that would overflow `stash_positions` is flushed in that step's pass.

    `window` (EngineConfig.mtp_window): the layer attends only the last `window` positions. The
    MTP KV of a position depends on that position alone (h_i and x_{i+1}), so positions that no
    later draft will attend need no pass at all: a prompt's pass covers only its last `window`
    positions (on a prefill engine that is the MTP layer's share of every prefill, a sizeable one
    on the bundled model), and a full stash drops its oldest positions instead of
    flushing them. Drafts need no exactness: this trades draft quality, measured unchanged on the
    bundled model at 32 and more (benchmarks/results/bench_spec.txt), for speed.
    """

    def __init__(self, model: CausalLM, states: RequestStates, kv_views, block_size: int, num_tokens: int,
                 device: torch.device, sampler: Sampler, sliding_window: int | None = None,
                 stash_positions: int = 256, grammar: GrammarStates | None = None, window: int | None = None) -> None:
        self.model, self.states, self.kv_views = model, states, kv_views
        self.grammar = grammar  # structured output: drafts follow each request's grammar
        self.block_size, self.k, self.device = block_size, num_tokens, device
        self.window = window
        windows = [w for w in (sliding_window, window) if w]
        self.sampler, self.sliding_window = sampler, min(windows) if windows else None
        self.stash_positions = stash_positions
        self.stash: torch.Tensor | None = None  # [slots, stash_positions, hidden], allocated on first use
        self._stash_bits: np.ndarray | None = None  # on CPU: the stash's bits as numpy (see _stash_rows)
        # Stash copies of steady k=0 steps (and of handed-over hidden states) not made yet, oldest first
        # (see _stash_one_each): (hidden, slots, stash index, position, steady steps before it).
        self._deferred: collections.deque[tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray, int]] = (
            collections.deque())
        self._steady_steps = 0  # steady k=0 steps stashed so far
        # Past this many steady steps an entry's positions have left the window of every row that decoded since.
        self._deferred_cap = (window or 62) + 2
        self.mode = DraftMode.INDEPENDENT
        self.writes_kv = True  # the MTP layers have their own paged cache
        self.check_invariants = invariants.enabled()
        # Draft chains as one C++ op, where the MTP layer is fused and attention is the C++ kernel's.
        self.fused_chain = (device.type == "cpu" and default_backend(device) == "cpp"
                            and kv_views[0][0].dtype == torch.float32)

    def propose(self, batch: InputBatch, hidden: torch.Tensor, accepted: list[list[int]], k: int,
                draft_meta: DraftMetadataFn, kv_tap: StepTap | None = None) -> Drafts:
        if kv_tap is not None and self.window is not None:
            # A prefill engine in PD (it never drafts). Rather than run the layer over its prompts'
            # last `window` positions, it hands their hidden states to the decode instance, whose
            # drafter runs the layer over them as over a stash -- the first time it drafts for the
            # request, which under load may be never.
            kv_tap.hand_over_hidden(batch.req_ids, batch.layout, hidden, self.window)
            kv_tap.last_layer_done()
            return Drafts.none(batch, k)
        if not k and kv_tap is None and batch.steady and self._stash_one_each(batch, hidden):
            # The common k=0 step under load (one position per row, nothing to hand over or verify):
            # stashed without the general bookkeeping below, a visible share of such a step.
            return Drafts.none(batch, k)
        self._materialize()  # (below, the stash is read and written directly)
        n_valid = batch.num_valid(accepted)
        if k and kv_tap is None:
            fused = self._fused_steady(batch, hidden, n_valid, accepted, k, draft_meta)
            if fused is not None:
                return fused
        # Rows whose prompt KV is handed to a decode instance (tapped) leave this engine after this
        # step: they need the MTP layer's KV of every prompt position now (no later pass would
        # backfill it; that includes a prompt cached up to its last token, which starts here as a
        # decode row). (Such an engine never drafts: ModelRunner.proposes_drafts.)
        handed_over = (kv_tap.tapped(batch.req_ids) if kv_tap is not None
                       else np.zeros(len(batch.req_ids), dtype=bool))
        drafting = batch.samples & (k > 0)
        in_pass = batch.is_prefilling | drafting | handed_over
        overflow = self._stash(batch, hidden, n_valid, ~in_pass)
        in_pass |= overflow
        drafts = Drafts.none(batch, k)
        drafts.flushed = bool(overflow.any())
        if not in_pass.any():
            return drafts
        pass_rows = np.nonzero(in_pass)[0]
        h = self._mtp_pass(batch, hidden, n_valid, pass_rows, accepted, drafting[pass_rows], kv_tap)
        if kv_tap is not None:
            kv_tap.last_layer_done()
        rows = np.nonzero(drafting)[0]
        if not len(rows):
            return drafts
        last_pos = (batch.layout.num_computed + n_valid - 1)[rows]
        table, drafts.probs = self._draft(batch, rows, h, last_pos, k, draft_meta)
        if drafts.probs is not None:
            drafts.probs_rows = rows
        for row, d in zip(rows.tolist(), table):
            drafts.token_ids[row] = d
        return drafts

    def backfill(self, slots: np.ndarray) -> int:
        return int(self.states.mtp_pending[slots].sum())

    def seed_from_handoff(self, slot: int, num_computed: int, hidden: torch.Tensor) -> None:
        """A request admitted with `num_computed` positions whose MTP layer did not run (a PD handoff):
        `hidden`, the target's hidden states of the last of them, becomes its stash, so that the
        layer runs over them the first time the row drafts. (Through the deferred copies: a slot's
        stash is written in the order of its requests.)"""
        n = min(len(hidden), num_computed, self.stash_positions, self.window or self.stash_positions)
        slots = np.full(n, slot, dtype=np.int32)
        self._deferred.append((hidden[len(hidden) - n :].to(self.device), slots, np.arange(n),
                               np.arange(num_computed - n, num_computed), self._steady_steps))
        self.states.mtp_pending[slot] = n

    def _fused_steady(self, batch: InputBatch, hidden: torch.Tensor, n_valid: np.ndarray,
                      accepted: list[list[int]], k: int, draft_meta: DraftMetadataFn) -> Drafts | None:
        """A drafting step where every row is a decode row with nothing stashed: the MTP pass over
        the kept positions and the draft chain as one C++ op (no attention context built on the
        host). None where the step is not such a step (the general path below then runs)."""
        st, slots = self.states, batch.slots
        if not self.fused_chain or not batch.samples.all() or batch.is_prefilling.any() or st.mtp_pending[slots].any():
            return None
        if self.window is not None and (st.total_len_np[slots] - 1 - self.window > batch.layout.num_computed).any():
            return None  # (a window shorter than a verify window)
        if self.grammar is not None and self.grammar.any_active(slots.tolist()):
            return None
        sampling = self._fused_sampling(slots, k, draft_meta)
        if sampling is None:
            return None
        qsl = batch.layout.query_start_loc
        if (n_valid == batch.layout.query_lens).all():
            h_in = hidden
        else:
            h_in = hidden.index_select(0, torch.from_numpy(np.concatenate(
                [np.arange(s, s + n) for s, n in zip(qsl[:-1].tolist(), n_valid.tolist())])).to(self.device))
        dev = self.device
        sampling["pass_ids"] = torch.tensor([t for toks in accepted for t in toks], dtype=torch.int32, device=dev)
        sampling["pass_len"] = torch.from_numpy(n_valid.astype(np.int32)).to(dev)
        fused = self._fused_drafts(h_in, batch.layout.num_computed + n_valid - 1, batch.layout.block_tables, k,
                                   sampling)
        if fused is None:
            return None
        table, probs = fused
        return Drafts(table, k, probs, None if probs is None else np.arange(len(slots)))

    def _fused_drafts(self, h: torch.Tensor, last_pos: np.ndarray, block_tables: np.ndarray, k: int,
                      args: dict) -> tuple[list[list[int]], torch.Tensor | None] | None:
        """CausalLM.fused_drafts over this drafter's MTP cache: the drafts, and their q where drawn
        independently (`args` holds `draft_probs`); `args`: its optional arguments."""
        dev = self.device
        k_cache, v_cache = self.kv_views[self.model.config.num_hidden_layers]
        drafts = self.model.fused_drafts(h, torch.from_numpy(last_pos.astype(np.int64)).to(dev), k, k_cache, v_cache,
                                         torch.from_numpy(np.ascontiguousarray(block_tables)).to(dev),
                                         self.block_size, self.sliding_window, **args)
        if drafts is None:
            return None
        return drafts.tolist(), args.get("draft_probs")

    def _fused_sampling(self, slots: np.ndarray, k: int, draft_meta: DraftMetadataFn) -> dict | None:
        """How the C++ chain (CausalLM.fused_drafts) picks these rows' k drafts (worker/sample/draft.py);
        None where it cannot (the Python path handles those)."""
        if self.mode is DraftMode.GREEDY:
            return {}
        if self.mode is DraftMode.INDEPENDENT and self._independent(slots):
            temps = [self.states.sampling_params[s].temperature for s in slots.tolist()]
            return independent_chain_args(self.model, self.sampler, temps, k, self.device)
        return coupled_chain_args(self.model, [draft_meta(slots, j) for j in range(k)], self.device)

    def _independent(self, slots: np.ndarray) -> bool:
        """Whether every row may draw its drafts independently: unseeded plain temperature, and past
        min_tokens (no stop token banned anywhere in the verify window, whose bans q knows nothing of)."""
        st = self.states
        return bool(st.plain_random[slots].all()
                    and (st.total_len_np[slots] - st.prompt_len[slots] >= st.min_tokens[slots]).all())

    def _stash(self, batch: InputBatch, hidden: torch.Tensor, n_valid: np.ndarray, rows_mask: np.ndarray) -> np.ndarray:
        """Keep the valid hidden states of rows that skip the layer; returns the rows that cannot."""
        overflow = np.zeros(len(batch.slots), dtype=bool)
        rows = np.nonzero(rows_mask)[0]
        if not len(rows):
            return overflow
        if self.stash is None:
            self._allocate_stash(hidden)
        pending, qsl = self.states.mtp_pending, batch.layout.query_start_loc
        slots = batch.slots[rows]
        if (n_valid[rows] == 1).all() and (pending[slots] < self.stash_positions).all():
            # One position per row: a single indexed copy.
            src = hidden.index_select(0, torch.from_numpy(qsl[rows]).to(self.device))
            self._stash_rows(slots, src, pending[slots])
            pending[slots] += 1
            return overflow
        for row in rows.tolist():
            slot, n = int(batch.slots[row]), int(n_valid[row])
            have = int(pending[slot])
            if have + n > self.stash_positions:
                if self.window is None or n >= self.window or self.window > self.stash_positions:
                    overflow[row] = True
                    continue
                # Positions that no draft will attend again are dropped, not flushed.
                keep = self.window - n
                self.stash[slot, :keep] = self.stash[slot, have - keep : have].clone()
                have = keep
            self.stash[slot, have : have + n] = hidden[qsl[row] : qsl[row] + n]
            pending[slot] = have + n
        return overflow

    def _stash_one_each(self, batch: InputBatch, hidden: torch.Tensor) -> bool:
        """Stash the one hidden state of every row of a steady step; False (nothing stashed) when
        some row's stash is full (the general path flushes it).

        The copy is deferred: the step's hidden states are kept by reference and copied into the
        stash only when the general path is about to read or write it (_materialize). Under load
        the policy holds k=0 for long runs of steps, and by the time drafting resumes most of those
        positions have left the window and are never copied at all; the copy itself (cold stash
        memory) is a small share of a big batch's step."""
        pending = self.states.mtp_pending
        at = pending[batch.slots]
        if (at >= self.stash_positions).any():
            return False
        self._steady_steps += 1
        self._deferred.append((hidden, batch.slots, at, batch.layout.num_computed, self._steady_steps))
        pending[batch.slots] = at + 1
        while self._deferred[0][4] <= self._steady_steps - self._deferred_cap:
            entry = self._deferred.popleft()
            # Since the entry, the deque has only held steady steps (the general path empties it),
            # each of which moved every row on by one: with a window, the entry is now out of the
            # window of each row still its slot's request, and stale for a slot reused since
            # (copying those was most of this path's cost under load, where slots turn over often).
            if self.window is None:
                self._write_deferred(*entry[:4])
        return True

    def _materialize(self) -> None:
        """Make the deferred stash copies, oldest first (as _stash_rows would have made them)."""
        while self._deferred:
            self._write_deferred(*self._deferred.popleft()[:4])

    def _write_deferred(self, hidden: torch.Tensor, slots: np.ndarray, at: np.ndarray, positions: np.ndarray) -> None:
        # Positions before a row's window (what _mtp_pass skips, and a full stash drops) are never read.
        # (A slot reused since reads only what its new request wrote, so these are never read either.)
        if self.window is not None and (positions < self.states.total_len_np[slots] - 1 - self.window).all():
            return
        if self.stash is None:
            self._allocate_stash(hidden)
        self._stash_rows(slots, hidden, at)

    def _stash_rows(self, slots: np.ndarray, src: torch.Tensor, at: np.ndarray) -> None:
        """Write src[i] at stash position at[i] of slots[i]."""
        if self._stash_bits is not None:  # on CPU a numpy assignment of the bits (no index tensor)
            self._stash_bits[slots, at] = _bits(src)
        else:
            flat = torch.from_numpy(slots.astype(np.int64) * self.stash_positions + at).to(self.device)
            self.stash.view(-1, src.shape[1]).index_copy_(0, flat, src)

    def _allocate_stash(self, hidden: torch.Tensor) -> None:
        self.stash = torch.empty(self.states.max_num_seqs, self.stash_positions, hidden.shape[1],
                                 dtype=hidden.dtype, device=self.device)
        if self.device.type == "cpu":
            self._stash_bits = _bits(self.stash)

    def _mtp_pass(self, batch: InputBatch, hidden: torch.Tensor, n_valid: np.ndarray, rows: np.ndarray,
                  accepted: list[list[int]], drafts_from: np.ndarray, kv_tap: StepTap | None) -> torch.Tensor | None:
        """The MTP layer over each row's stashed positions followed by this step's valid ones;
        returns its output at the last valid position of the rows where `drafts_from` (None if none).

        Position i pairs h_i with x_{i+1}, read from all_token_ids after write-back (the next
        prompt token, an accepted draft, or the token just sampled): always in bounds, since
        every position run here is valid and so has a successor. Only the positions drafts start
        from run the whole layer; the others (a prompt's, a backfilled stash's) only write its K/V.
        """
        st, dev = self.states, self.device
        slots = batch.slots[rows]
        pending = st.mtp_pending[slots].copy()
        start = (batch.layout.num_computed[rows] - pending).astype(np.int32)
        lens = (pending + n_valid[rows]).astype(np.int32)
        # No query from now on comes before a row's last valid position (total_len - 2), and one at q
        # attends [q - window + 1, q]: earlier positions need no pass (each row keeps at least its
        # last one, though: a tapped prompt's MTP layer is reported by the pass).
        skip = np.zeros(len(rows), dtype=np.int32)
        if self.window is not None:
            skip = np.clip(st.total_len_np[slots] - 1 - self.window - start, 0, lens - 1).astype(np.int32)
            start, lens = start + skip, lens - skip
        qsl = batch.layout.query_start_loc
        pieces = []
        for row, slot, have, cut in zip(rows.tolist(), slots.tolist(), pending.tolist(), skip.tolist()):
            if have > cut:
                pieces.append(self.stash[slot, cut:have])
            pieces.append(hidden[qsl[row] + max(0, cut - have) : qsl[row] + n_valid[row]])
        h_in = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        layout = StepLayout(batch.layout.block_tables[rows], start, lens)
        if not pending.any() and not skip.any() and not batch.is_prefilling[rows].any():
            # A steady decode step: the successor of each kept position is the token kept after it.
            next_ids = torch.tensor([t for r in rows.tolist() for t in accepted[r]], dtype=torch.int32, device=dev)
            if self.check_invariants and not torch.equal(next_ids, self._gather_next_ids(slots, layout, start)):
                raise invariants.InvariantViolation("MTP pass: the kept tokens are not the successors in all_token_ids")
        else:
            next_ids = self._gather_next_ids(slots, layout, start)
        st.mtp_pending[slots] = 0
        return self._run_layer([batch.req_ids[r] for r in rows.tolist()], layout, h_in, next_ids, drafts_from, kv_tap)

    def _run_layer(self, req_ids: list[str], layout: StepLayout, h_in: torch.Tensor, next_ids: torch.Tensor,
                   drafts_from: np.ndarray, kv_tap: StepTap | None) -> torch.Tensor | None:
        """The layer over `layout`'s positions: whole at the last position of each row where
        `drafts_from` (its output, returned), only its K/V at the others (written first: the whole
        layer attends them; reported to `kv_tap`, if any)."""
        dev, lens, start = self.device, layout.query_lens, layout.num_computed
        kv_lens = lens - drafts_from
        if kv_lens.any():
            kv_rows = np.nonzero(kv_lens)[0]
            kv_layout = StepLayout(layout.block_tables[kv_rows], start[kv_rows], kv_lens[kv_rows])
            if drafts_from.any():  # the positions up to each drafting row's last
                keep = torch.from_numpy(np.concatenate([np.arange(s, s + n) for s, n in zip(
                    layout.query_start_loc[kv_rows].tolist(), kv_lens[kv_rows].tolist())])).to(dev)
                kv_h, kv_ids = h_in[keep], next_ids[keep]
            else:
                kv_h, kv_ids = h_in, next_ids
            writer = CacheWriter(self.kv_views, kv_layout, self.block_size, dev)
            if kv_tap is not None:
                writer.tap = kv_tap.layer_tap([req_ids[r] for r in kv_rows.tolist()], kv_layout)
            self.model.mtp_write_kv(0, kv_h, kv_ids, writer.positions, writer,
                                    has_position0=bool((kv_layout.num_computed == 0).any()))
        if not drafts_from.any():
            return None
        out_rows = np.nonzero(drafts_from)[0]
        ends = (start + lens - 1)[out_rows].astype(np.int32)
        ctx = AttentionContext(self.kv_views, StepLayout(layout.block_tables[out_rows], ends, np.ones_like(ends)),
                               self.block_size, dev, self.sliding_window)
        if len(out_rows) < len(lens) or kv_lens.any():
            pick = torch.from_numpy(layout.query_start_loc[1:][out_rows] - 1).to(dev)
            h_in, next_ids = h_in[pick], next_ids[pick]
        return self.model.mtp_forward(0, h_in, next_ids, ctx.positions, ctx, has_position0=bool((ends == 0).any()))

    def _gather_next_ids(self, slots: np.ndarray, layout: StepLayout, start: np.ndarray) -> torch.Tensor:
        """x_{i+1} for every position i of the pass, from all_token_ids."""
        dev = self.device
        next_ids = torch.empty(int(layout.query_start_loc[-1]), dtype=torch.int32, device=dev)
        everyone = torch.ones(len(slots), dtype=torch.bool, device=dev)
        kernels.gather_prefill_tokens(next_ids, self.states.all_token_ids, torch.from_numpy(slots).to(dev),
                                      torch.from_numpy(layout.query_start_loc).to(dev),
                                      torch.from_numpy(start + 1).to(dev), everyone)
        return next_ids

    def _draft(self, batch: InputBatch, rows: np.ndarray, h: torch.Tensor, last_pos: np.ndarray, k: int,
               draft_meta: DraftMetadataFn) -> tuple[list[list[int]], torch.Tensor | None]:
        """k drafts per row, and their q where drawn independently: the layer applied recursively on
        its own hidden state, one position further each time. These KV writes land in lookahead slots
        that the next verify overwrites."""
        slots = batch.slots[rows]
        walk = self.grammar.draft_walk(slots.tolist()) if self.grammar is not None else None
        try:
            return self._draft_walk(batch, rows, h, last_pos, k, draft_meta, walk)
        finally:
            if walk is not None:
                walk.close()

    def _draft_walk(self, batch: InputBatch, rows: np.ndarray, h: torch.Tensor, last_pos: np.ndarray, k: int,
                    draft_meta: DraftMetadataFn, walk: DraftWalk | None) -> tuple[list[list[int]], torch.Tensor | None]:
        slots = batch.slots[rows]
        sampling = self._fused_sampling(slots, k, draft_meta) if walk is None and self.fused_chain else None
        if sampling is not None:
            fused = self._fused_drafts(h, last_pos, batch.layout.block_tables[rows], k, sampling)
            if fused is not None:
                return fused
        token = self._pick(h, slots, 0, draft_meta, walk)
        proposed = [token]
        block_tables = batch.layout.block_tables[rows]
        ones = np.ones(len(rows), dtype=np.int32)
        for i in range(1, k):
            layout = StepLayout(block_tables, (last_pos + i).astype(np.int32), ones)
            step_ctx = AttentionContext(self.kv_views, layout, self.block_size, self.device, self.sliding_window)
            h = self.model.mtp_forward(0, h, token, step_ctx.positions, step_ctx, has_position0=False)
            token = self._pick(h, slots, i, draft_meta, walk)
            proposed.append(token)
        return torch.stack(proposed, dim=1).tolist(), None

    def _pick(self, h: torch.Tensor, slots: np.ndarray, j: int, draft_meta: DraftMetadataFn,
              walk: DraftWalk | None = None) -> torch.Tensor:
        """Draft j of each row from the MTP hidden states `h` (int32 token ids)."""
        meta = draft_meta(slots, j) if self.mode is not DraftMode.GREEDY else None
        # A draft the grammar refuses could never be accepted: it is not proposed.
        token = pick_draft_tokens(self.model, self.sampler, h, meta, walk.mask() if walk is not None else None)
        if walk is not None:
            walk.accept(token.tolist())
        return token


def _bits(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array of same-size integers (numpy has no bfloat16)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).numpy()
