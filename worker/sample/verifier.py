"""The verifier: every way a step's tokens are chosen, behind one call.

`Verifier.sample(batch, hidden)` returns the tokens each row keeps this step (`StepTokens`):

- a plain greedy decode batch: the argmax of the raw logits (one C++ pass on a CPU);
- a plain-temperature decode batch on a CPU: one C++ draw per row (fused_ops.rejection_verify with
  no drafts);
- otherwise, per row, the positions it samples (a prefill chunk's end, or a verify window of
  1 + k): rows whose drafts were drawn independently from the drafter's q go to the standard
  rejection sampler (fused_ops.rejection_verify), the others sample every position from the target
  (seeded, keyed, penalised, grammar-masked as the request asks; worker/sample/sampler.py) and keep
  the drafts that equal those samples (worker/sample/matching.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.types import TokenLogprobs
from worker import fused_ops
from worker.input_batch import InputBatch
from worker.models.llama import CausalLM
from worker.sample.matching import accept_matching_prefix
from worker.sample.metadata import PositionMetadata, num_output
from worker.sample.sampler import Sampler
from worker.states import RequestStates
from worker.structured import GrammarStates


@dataclass
class StepTokens:
    """What one step sampled, per batch row."""

    accepted: list[list[int]]  # the row's sampled token, or its accepted drafts plus one; [] if it did not sample
    logprobs: list[list[TokenLogprobs]] | None = None
    # Whether some row drew from a distribution (not every row greedy): such steps cost more
    # (softmax, keyed noise), so the speculation policy times them apart.
    sampled: bool = False


def check_in_vocab(rows: list[list[int]], vocab: int, what: str) -> None:
    """The last line of defence of the sampler's contract (every id in [0, vocab), whatever the
    logits hold): an id outside would be streamed to the client and index past the embedding
    table as the next input. Raising fails this step's requests (EngineCore._fail_step)."""
    for row in rows:
        if row and not all(0 <= t < vocab for t in row):
            raise RuntimeError(f"a {what} token id in {row} is outside the vocabulary [0, {vocab})")


class Verifier:
    def __init__(self, model: CausalLM, states: RequestStates, grammar: GrammarStates, eos_token_ids: list[int],
                 device: torch.device, noise_seed: int, fused_sampling: bool) -> None:
        self.model, self.states, self.grammar, self.device = model, states, grammar, device
        # `noise_seed` seeds the default generator: the noise of unseeded rows (the drafter shares it).
        self.sampler = Sampler(seed=noise_seed, device=device)
        # Plain-temperature decode steps sample with the C++ op (its torch reference is a loop per row).
        self.fused_sampling = fused_sampling
        self.position_metadata = PositionMetadata(states, eos_token_ids, device)

    def sample(self, batch: InputBatch, hidden: torch.Tensor) -> StepTokens:
        """Tokens each row keeps this step: one sampled token, or verified drafts plus a bonus."""
        if batch.steady and self._plain_greedy(batch.slots):
            # Every row decodes one token by plain argmax: what the general path below computes
            # for such a batch, without its bookkeeping, which is a visible share of a small batch's step.
            tokens = fused_ops.argmax(self.model.compute_logits(hidden).float()).tolist()
            return StepTokens([[t] for t in tokens])
        if batch.steady and self.fused_sampling and self._plain_random(batch.slots):
            return self._sample_plain_random(batch.slots, hidden)
        rows = np.nonzero(batch.samples)[0]
        if not len(rows):
            return StepTokens([[] for _ in batch.req_ids])
        k = batch.num_drafts[rows]
        # Row r needs logits at its last 1 + k[r] positions (the verified drafts and the bonus);
        # decode and verify steps need every position, prefill chunks only their ends.
        if int(k.sum()) + len(rows) < hidden.shape[0]:
            ends = batch.layout.query_start_loc[1:][rows]
            positions = np.concatenate([np.arange(e - 1 - n, e) for e, n in zip(ends, k)])
            hidden = hidden[torch.from_numpy(positions).to(self.device)]
        logits = self.model.compute_logits(hidden)
        slots = batch.slots[rows]
        kept, sampled = self._verify(logits, k, slots)
        accepted: list[list[int]] = [[] for _ in batch.req_ids]
        for row, toks in zip(rows.tolist(), kept):
            accepted[row] = toks
        return StepTokens(accepted, self._logprobs(logits, k, slots, rows, kept, len(batch.req_ids)), sampled)

    def _verify(self, logits: torch.Tensor, k: np.ndarray, slots: np.ndarray) -> tuple[list[list[int]], bool]:
        """Tokens kept per sampling row, and whether some row drew from a distribution."""
        table = self.states.draft_tokens_np[slots, : max(1, int(k.max()))].tolist()
        drafts = [row[:n] for row, n in zip(table, k.tolist())]
        # Rows whose drafts were drawn independently go to the standard rejection sampler with their
        # q; the others are verified by matching the target's own (keyed) samples. Most steps are all
        # one or the other, and skip the split (its small array ops are not free at batch 1).
        independent = self.states.draft_has_probs[slots] & (k > 0)
        if independent.all():
            return self._verify_independent(logits, k, slots, drafts), True
        if not independent.any():
            return self._verify_matching(logits, k, slots, drafts)
        kept: list[list[int]] = [[] for _ in slots]
        starts = np.cumsum(k + 1) - (k + 1)  # row r's logits are [starts[r], starts[r] + 1 + k[r])

        def rows_of(group: np.ndarray) -> tuple:
            picked = logits[torch.from_numpy(np.concatenate(
                [np.arange(starts[i], starts[i] + 1 + k[i]) for i in group])).to(self.device)]
            return picked, k[group], slots[group], [drafts[i] for i in group]

        # (independent rows first: both draw from the default generator, in this order)
        independent_rows, matching_rows = np.nonzero(independent)[0], np.nonzero(~independent)[0]
        for i, toks in zip(independent_rows.tolist(), self._verify_independent(*rows_of(independent_rows))):
            kept[i] = toks
        for i, toks in zip(matching_rows.tolist(), self._verify_matching(*rows_of(matching_rows))[0]):
            kept[i] = toks
        return kept, True

    def _verify_matching(self, logits: torch.Tensor, k: np.ndarray, slots: np.ndarray,
                         drafts: list[list[int]]) -> tuple[list[list[int]], bool]:
        """Tokens kept per row: every verified position sampled from the target (argmax for greedy
        rows; the noise of a drafted position keyed, see PositionMetadata), and the drafts that
        equal those samples (accept_matching_prefix); and whether some row drew from a distribution."""
        if self._plain_greedy(slots):  # the target's argmax at every position, no metadata needed
            targets = fused_ops.argmax(logits.float()).tolist()
            return accept_matching_prefix(targets, k.tolist(), drafts).accepted_token_ids, False
        # Row r owns positions [starts[r], starts[r] + 1 + k[r]) at output indices n_out[r] + 0..k[r].
        width = k + 1
        starts = np.cumsum(width) - width
        pos_slots = np.repeat(slots, width)
        out_index = np.repeat(num_output(self.states, slots) - starts, width) + np.arange(int(width.sum()))
        drafts_before = [d[:j] for d in drafts for j in range(len(d) + 1)]
        drafted = np.arange(int(width.sum())) < np.repeat(starts + k, width)  # all but each row's bonus
        meta = self.position_metadata(pos_slots, out_index, drafts_before, drafted)
        constrained = self.grammar.any_active(slots.tolist())
        if constrained:  # structured output: position j masked after drafts[:j]
            meta.allowed_token_mask = self.grammar.position_masks(slots.tolist(), drafts)
        targets = self.sampler(logits, meta).sampled_token_ids.tolist()  # the step's one sync
        kept = accept_matching_prefix(targets, k.tolist(), drafts).accepted_token_ids
        if constrained:  # unconstrained batches skip the per-row matcher calls
            for slot, toks in zip(slots.tolist(), kept):
                self.grammar.advance(slot, toks)
        return kept, not meta.all_greedy

    def _verify_independent(self, logits: torch.Tensor, k: np.ndarray, slots: np.ndarray,
                            drafts: list[list[int]]) -> list[list[int]]:
        """Tokens kept per row whose drafts were drawn independently from q (DraftMode.INDEPENDENT:
        unseeded, plain temperature, past min_tokens): the standard rejection sampler
        (fused_ops.rejection_verify). Its uniforms come from the sampler's default generator: these
        rows have no seed to key them by."""
        st, dev = self.states, self.device
        slot_list, k_list = slots.tolist(), k.tolist()
        q = (st.draft_probs[slot_list[0], : k_list[0]] if len(slot_list) == 1
             else torch.cat([st.draft_probs[s, :n] for s, n in zip(slot_list, k_list)]))
        flat = [t for d in drafts for t in d]
        u = torch.rand(len(flat) + len(slot_list), generator=self.sampler.default_generator(dev),
                       device=dev)  # each draft's, then each row's
        result = fused_ops.rejection_verify(
            logits.float(), torch.tensor([st.sampling_params[s].temperature for s in slot_list], device=dev),
            torch.tensor(k_list, dtype=torch.int32, device=dev), torch.tensor(flat, dtype=torch.int32, device=dev),
            q, self.model.draft_vocab, u[: len(flat)], u[len(flat) :]).tolist()
        return [d[:m] + [tok] for d, (m, tok) in zip(drafts, result)]

    def _sample_plain_random(self, slots: np.ndarray, hidden: torch.Tensor) -> StepTokens:
        """One token per row from softmax(logits / T), by inverse CDF with one uniform each from the
        default generator: what the general path draws for such rows (Sampler.sample_from_probs),
        as one C++ pass -- fused_ops.rejection_verify with no drafts, whose final draw is that one --
        instead of the per-position metadata and its many torch ops, whose dispatch dominates at a few rows."""
        st, dev, n = self.states, self.device, len(slots)
        logits = self.model.compute_logits(hidden).float()
        temps = torch.tensor([st.sampling_params[s].temperature for s in slots.tolist()], dtype=torch.float32)
        u = torch.rand(n, generator=self.sampler.default_generator(dev), device=dev)
        no_drafts = torch.empty(0, dtype=torch.int32)
        drawn = fused_ops.rejection_verify(logits, temps, torch.zeros(n, dtype=torch.int32), no_drafts,
                                           torch.empty(0, 0), None, torch.empty(0), u)
        kept = [[t] for t in drawn[:, 1].tolist()]
        return StepTokens(kept, self._logprobs(logits, np.zeros(n, dtype=np.int64), slots, np.arange(n), kept, n),
                          True)

    def _plain_random(self, slots: np.ndarray) -> bool:
        """Whether sampling these slots' next positions is a plain-temperature draw from the default
        generator: unseeded, no penalties, grammar, top-k, top-p or min-p (RequestStates.plain_random),
        and past min_tokens (no stop token banned)."""
        st = self.states
        return bool(st.plain_random[slots].all() and (num_output(st, slots) >= st.min_tokens[slots]).all())

    def _plain_greedy(self, slots: np.ndarray) -> bool:
        """Whether sampling these slots' next positions is the argmax of the raw logits: greedy,
        no penalties, grammar or logprobs, and past min_tokens (so no stop token is banned at
        any position of a verify window either)."""
        st = self.states
        return bool(st.plain_greedy[slots].all() and (num_output(st, slots) >= st.min_tokens[slots]).all())

    def _logprobs(self, logits: torch.Tensor, k: np.ndarray, slots: np.ndarray, rows: np.ndarray,
                  kept: list[list[int]], batch_size: int) -> list[list[TokenLogprobs]] | None:
        """Per kept token: its logprob and rank under the raw target logits, plus the top-n."""
        wants = [self.states.sampling_params[int(s)].logprobs for s in slots]
        if all(n is None for n in wants):
            return None
        starts = np.concatenate([[0], np.cumsum(k + 1)[:-1]])
        picks = [(i, starts[i] + j, tok) for i, toks in enumerate(kept) if wants[i] is not None
                 for j, tok in enumerate(toks)]
        idx = torch.tensor([p[1] for p in picks], dtype=torch.long, device=self.device)
        toks = torch.tensor([p[2] for p in picks], dtype=torch.long, device=self.device)
        n_max = max(n for n in wants if n is not None)
        lp = self.sampler.gather_logprobs(torch.log_softmax(logits[idx], dim=-1), toks, n_max)
        ids, vals, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
        result: list[list[TokenLogprobs]] = [[] for _ in range(batch_size)]
        for m, (i, _, _) in enumerate(picks):
            n = wants[i]
            result[int(rows[i])].append(TokenLogprobs(ids[m][0], vals[m][0], ranks[m],
                                                      list(zip(ids[m][1 : 1 + n], vals[m][1 : 1 + n]))))
        return result
