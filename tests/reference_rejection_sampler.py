"""The reference rejection sampler (tests only): the standard algorithm over explicit distributions.

The engine verifies drafts in worker/sample/ (``accept_matching_prefix`` and the C++
``fused_ops.rejection_verify``); this module keeps the textbook form that the tests compare them
with and check for exactness. What follows describes both.

One target forward scores ``1 + k_b`` positions for request ``b``: position 0
predicts the token after the last accepted one (and so verifies draft 1),
position ``j`` predicts the token after draft ``j`` (verifying draft ``j + 1``),
and position ``k_b`` yields the bonus token when every draft is accepted.

The engine verifies with :func:`worker.sample.matching.accept_matching_prefix`: every position is
sampled from the target distribution -- with noise keyed by (request seed, output
index) for a seeded request and at every drafted position, from the engine's default
generator elsewhere -- and the drafts are accepted while they equal those samples. For a draft
proposed deterministically this *is* the rejection sampling described next (it
accepts with probability ``p(d)`` and, on a rejection, emits a token distributed as
``p`` without ``d``), realised with a particular choice of randomness; for drafts
drawn with that same keyed noise it is Gumbel-max coupling. Either way the emitted
tokens are exactly what non-speculative sampling with the same noise emits, so a
seeded request's output does not depend on how many drafts were verified when.
:class:`RejectionSampler` keeps the standard algorithm for drafts drawn
independently from a draft distribution ``q`` passed explicitly.

Random requests use speculative rejection sampling (Leviathan et al. 2023,
Chen et al. 2023): draft ``d`` with draft probability ``q(d)`` is accepted with
probability ``min(1, p(d) / q(d))``; on the first rejection the emitted token is
drawn from ``normalize(max(0, p - q))`` and the walk stops; if every draft is
accepted the bonus token is drawn from ``p`` at the last position. Every emitted
token is then distributed exactly as ``p`` (the output of
:meth:`Sampler.compute_probs`, i.e. after penalties, bans, temperature, top-k,
top-p and min-p). When the drafts were proposed deterministically
(``draft_probs=None``: greedy MTP, n-gram lookup) ``q`` is a one-hot at the
draft, which reduces to "accept with probability ``p(d)``, else draw from ``p``
with ``d`` removed". That rule preserves ``p`` *conditionally on each draft
token*, so it stays exact whatever process proposed the draft.

Greedy requests accept the longest prefix of drafts equal to the target argmax
and then emit the target argmax, which is token for token what non-speculative
greedy decoding produces.

Randomness pattern (what makes seeded requests reproducible): when the batch is
not all-greedy, a request with its own generator draws exactly ``k_b`` uniforms
(``torch.rand``) and then exactly ``V`` uniforms for the exponential race of
:meth:`Sampler.sample_from_probs` from that generator -- the same number
whatever is accepted and whoever else is in the batch. A request with
``k_b = 0`` therefore draws exactly what a plain :class:`Sampler` step would.
Requests without a generator share batched draws from the sampler's default
generator.

Penalties and bans: position ``j`` of request ``b`` is penalised with the
output context ``output_token_ids[b] + drafts[b][:j]`` -- exactly the context a
non-speculative step would have at that point if the drafts up to ``j`` are
accepted (and if one is not, later positions are discarded anyway). So
penalised greedy speculative decoding is exact too. ``banned_token_ids[b]`` is
applied unchanged to every position of request ``b``; a caller whose bans
depend on the output length (e.g. ``min_tokens`` banning EOS) must pass the
conservative set for the whole verified window. Logprobs are not produced here.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker import fused_ops
from worker.sample.matching import RejectionOutput, accept_matching_prefix
from worker.sample.sampler import GREEDY_TEMPERATURE_EPS, Sampler, SamplingMetadata

__all__ = ["RejectionOutput", "RejectionSampler", "accept_matching_prefix"]

logger = logging.getLogger(__name__)


@dataclass
class _DraftIndex:
    """Where each request's drafts sit: host lists and their device copies (O(sum k_b) host work)."""

    ks: list[int]                 # k_b per request
    draft_starts: list[int]       # first flat draft index of request b
    num_drafts: int
    drafts: torch.Tensor          # [sum k] the draft tokens, flat
    req_of_draft: torch.Tensor    # [sum k] request of each draft
    pos_of_draft: torch.Tensor    # [sum k] its position in its request's window
    verify_rows: torch.Tensor     # [sum k] logits row that verifies it (draft j of b: position j)
    ks_t: torch.Tensor
    row_starts: torch.Tensor      # [B] first logits row of each request
    draft_starts_t: torch.Tensor

    @classmethod
    def build(cls, ks: list[int], draft_token_ids: Sequence[Sequence[int]], device: torch.device) -> _DraftIndex:
        def long_tensor(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

        row_starts = list(itertools.accumulate((1 + k for k in ks), initial=0))[:-1]
        draft_starts = list(itertools.accumulate(ks, initial=0))[:-1]
        req_of_draft = [b for b, k in enumerate(ks) for _ in range(k)]
        pos_of_draft = [j for k in ks for j in range(k)]
        return cls(ks, draft_starts, sum(ks), long_tensor(list(itertools.chain.from_iterable(draft_token_ids))),
                   long_tensor(req_of_draft), long_tensor(pos_of_draft),
                   long_tensor([row_starts[b] + j for b, j in zip(req_of_draft, pos_of_draft)]),
                   long_tensor(ks), long_tensor(row_starts), long_tensor(draft_starts))

    def accepted_prefix(self, accept: torch.Tensor) -> torch.Tensor:
        """[B] number of accepted drafts: the length of each request's all-accepted prefix."""
        num_reqs, max_k = len(self.ks), max(self.ks)
        if max_k == 0:
            return torch.zeros(num_reqs, dtype=torch.long, device=accept.device)
        # Padding beyond k_b stays False, so the prefix can never run past k_b.
        padded = torch.zeros(num_reqs, max_k, dtype=torch.long, device=accept.device)
        padded[self.req_of_draft, self.pos_of_draft] = accept.long()
        return padded.cumprod(dim=1).sum(dim=1)


class RejectionSampler:
    """Verifies draft tokens against the target model's logits (see the module docstring).

    Holds no state of its own: the target distribution, the final draw and the
    default generator all come from the wrapped :class:`Sampler`.
    """

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(
        self,
        logits: torch.Tensor,
        num_draft_tokens: list[int],
        draft_token_ids: list[list[int]],
        draft_probs: torch.Tensor | None,
        meta: SamplingMetadata,
    ) -> RejectionOutput:
        """Verify the drafts of every request.

        Args:
            logits: ``[sum_b (1 + k_b), V]`` target logits, rows grouped per request in order.
            num_draft_tokens: ``k_b`` per request.
            draft_token_ids: per request, its ``k_b`` draft tokens.
            draft_probs: ``[sum_b k_b, V]`` draft distributions ``q`` (rows need to hold the
                probabilities the drafts were sampled from), or ``None`` when the drafts
                were proposed deterministically (``q`` one-hot at the draft).
            meta: one row per request; it is expanded to one row per position here.
        """
        num_reqs = len(num_draft_tokens)
        self._validate(logits, num_draft_tokens, draft_token_ids, draft_probs, meta)
        if num_reqs == 0:
            return RejectionOutput(accepted_token_ids=[], num_accepted_drafts=[])
        if meta.all_greedy and meta.no_penalties and meta.banned_token_ids is None:
            return self._greedy(logits, num_draft_tokens, draft_token_ids)
        ix = _DraftIndex.build(list(num_draft_tokens), draft_token_ids, logits.device)
        # One metadata row per position, then penalties/bans and the target distribution
        # for all positions at once.
        pos_meta = self._expand_meta(meta, ix.ks, draft_token_ids)
        logits = self.sampler.apply_penalties_and_bans(logits.float(), pos_meta)
        # [T]: the greedy target at every position (None when no row is greedy: nothing reads it)
        target_argmax = None if meta.no_greedy else fused_ops.argmax(logits)
        probs = None if meta.all_greedy else self.sampler.compute_probs(logits, pos_meta)  # [T, V]
        if draft_probs is not None:
            draft_probs = draft_probs.to(device=logits.device, dtype=torch.float32)
        accept = self._accept_each(ix, target_argmax, probs, draft_probs, meta)
        num_accepted = ix.accepted_prefix(accept)
        final_tokens = self._final_tokens(ix, num_accepted, target_argmax, probs, draft_probs, meta)
        # Back to Python lists (the one device sync of the call).
        num_accepted_list, final_list = torch.stack([num_accepted, final_tokens.long()]).tolist()
        accepted_token_ids = [
            list(draft_token_ids[b][:m]) + [tok] for b, (m, tok) in enumerate(zip(num_accepted_list, final_list))
        ]
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("verified %d drafts over %d requests: %d accepted", ix.num_drafts, num_reqs,
                         sum(num_accepted_list))
        return RejectionOutput(accepted_token_ids=accepted_token_ids, num_accepted_drafts=num_accepted_list)

    def _accept_each(self, ix: _DraftIndex, target_argmax: torch.Tensor | None, probs: torch.Tensor | None,
                     draft_probs: torch.Tensor | None, meta: SamplingMetadata) -> torch.Tensor:
        """Accept/reject every draft independently (the prefix is taken afterwards)."""
        if probs is None:
            return target_argmax[ix.verify_rows] == ix.drafts
        p_draft = probs[ix.verify_rows, ix.drafts]
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)
        else:
            q_draft = draft_probs[torch.arange(ix.num_drafts, device=probs.device), ix.drafts]
        uniforms = self._draw_uniforms(meta, ix.ks, ix.draft_starts, ix.num_drafts, probs.device)
        # u < p/q written without the division: accepts with probability min(1, p/q),
        # never accepts a token the target rules out (p = 0), and needs no q > 0 guard.
        random_accept = uniforms * q_draft < p_draft
        if meta.no_greedy:
            return random_accept
        greedy = meta.temperature < GREEDY_TEMPERATURE_EPS  # [B]
        return torch.where(greedy[ix.req_of_draft], target_argmax[ix.verify_rows] == ix.drafts, random_accept)

    def _final_tokens(self, ix: _DraftIndex, num_accepted: torch.Tensor, target_argmax: torch.Tensor | None,
                      probs: torch.Tensor | None, draft_probs: torch.Tensor | None,
                      meta: SamplingMetadata) -> torch.Tensor:
        """The one token after the accepted prefix: recovered (after a rejection) or the bonus."""
        final_rows = ix.row_starts + num_accepted  # logits row of the first unaccepted position
        if probs is None:
            return target_argmax[final_rows]
        final_p = probs[final_rows]  # [B, V]
        final_dist = final_p
        if ix.num_drafts:
            rejected = num_accepted < ix.ks_t
            # Index of the rejected draft (clamped so all-accepted rows index something valid;
            # their residual is masked out below).
            rej_draft = (ix.draft_starts_t + num_accepted).clamp(max=ix.num_drafts - 1)
            if draft_probs is None:
                final_q = torch.zeros_like(final_p).scatter_(1, ix.drafts[rej_draft].unsqueeze(1), 1.0)
            else:
                final_q = draft_probs[rej_draft]
            residual = (final_p - final_q).clamp_min_(0.0)
            # p == q leaves nothing: a rejection then only happens for p(d) = 0, and p itself
            # is the right distribution. sample_from_probs normalises implicitly.
            use_residual = rejected & (residual.sum(dim=-1) > 0)
            final_dist = torch.where(use_residual.unsqueeze(1), residual, final_p)
        # B rows with the requests' own generators: exactly V uniforms per seeded row.
        sampled = self.sampler.sample_from_probs(final_dist, meta)
        if meta.no_greedy:
            return sampled
        greedy = meta.temperature < GREEDY_TEMPERATURE_EPS
        return torch.where(greedy, target_argmax[final_rows], sampled)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _greedy(logits: torch.Tensor, ks: Sequence[int], draft_token_ids: Sequence[Sequence[int]]) -> RejectionOutput:
        """All-greedy batch without penalties or bans (the common case): one argmax, one sync, and
        the prefix walk on the host. Same result as the general path, a fraction of its ops."""
        return accept_matching_prefix(fused_ops.argmax(logits).tolist(), ks, draft_token_ids)

    @staticmethod
    def _validate(
        logits: torch.Tensor,
        num_draft_tokens: Sequence[int],
        draft_token_ids: Sequence[Sequence[int]],
        draft_probs: torch.Tensor | None,
        meta: SamplingMetadata,
    ) -> None:
        num_reqs = len(num_draft_tokens)
        if logits.dim() != 2:
            raise ValueError(f"logits must be [positions, vocab], got shape {tuple(logits.shape)}")
        if meta.num_rows != num_reqs:
            raise ValueError(f"metadata has {meta.num_rows} rows but there are {num_reqs} requests")
        if len(draft_token_ids) != num_reqs:
            raise ValueError(f"{len(draft_token_ids)} draft lists for {num_reqs} requests")
        for b, (k, drafts) in enumerate(zip(num_draft_tokens, draft_token_ids)):
            if k < 0 or len(drafts) != k:
                raise ValueError(f"request {b}: num_draft_tokens={k} but {len(drafts)} draft tokens")
        expected_rows = num_reqs + sum(num_draft_tokens)
        if logits.shape[0] != expected_rows:
            raise ValueError(f"logits have {logits.shape[0]} rows, expected sum(1 + k_b) = {expected_rows}")
        vocab = logits.shape[1]
        flat = [t for drafts in draft_token_ids for t in drafts]
        if flat and (min(flat) < 0 or max(flat) >= vocab):
            raise ValueError(f"draft token ids must lie in [0, {vocab}), got range [{min(flat)}, {max(flat)}]")
        if draft_probs is not None and tuple(draft_probs.shape) != (len(flat), vocab):
            raise ValueError(f"draft_probs must be [{len(flat)}, {vocab}], got {tuple(draft_probs.shape)}")

    @staticmethod
    def _expand_meta(
        meta: SamplingMetadata, ks: Sequence[int], draft_token_ids: Sequence[Sequence[int]]
    ) -> SamplingMetadata:
        """One metadata row per verified position, with each position's penalty context."""
        rows = [b for b, k in enumerate(ks) for _ in range(1 + k)]
        pos_meta = meta.select_rows(rows)
        if not meta.no_penalties and meta.output_token_ids is not None:
            # Position j follows drafts 1..j: a non-speculative step there would count them
            # as output tokens, so the penalties must too (this keeps penalised greedy exact).
            pos_meta.output_token_ids = [
                list(meta.output_token_ids[b]) + list(draft_token_ids[b][:j])
                for b, k in enumerate(ks)
                for j in range(1 + k)
            ]
        return pos_meta

    def _draw_uniforms(
        self,
        meta: SamplingMetadata,
        ks: Sequence[int],
        draft_starts: Sequence[int],
        num_drafts: int,
        device: torch.device,
    ) -> torch.Tensor:
        """``[sum k_b]`` U[0, 1) acceptance variates: exactly ``k_b`` from each seeded request's
        own generator, one batched draw from the default generator for the rest."""
        uniforms = torch.empty(num_drafts, dtype=torch.float32, device=device)
        unseeded = [
            draft_starts[b] + j for b, (k, g) in enumerate(zip(ks, meta.generators)) if g is None for j in range(k)
        ]
        if unseeded:
            default_gen = self.sampler.default_generator(device)
            draws = torch.rand(len(unseeded), generator=default_gen, device=device)
            if len(unseeded) == num_drafts:
                uniforms = draws
            else:
                uniforms[torch.tensor(unseeded, dtype=torch.long, device=device)] = draws
        for b, (k, gen) in enumerate(zip(ks, meta.generators)):
            if gen is None or k == 0:
                continue
            if gen.device.type != device.type:
                raise ValueError(
                    f"request {b}: its generator is on {gen.device} but the logits are on {device}; "
                    "create per-request generators on the model's device"
                )
            start = draft_starts[b]
            uniforms[start:start + k] = torch.rand(k, generator=gen, device=device)
        return uniforms
