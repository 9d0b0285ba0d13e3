"""How a drafter picks its draft tokens: the draft-side half of sampling.

The MTP drafter runs its layer; which token each draft is, and the noise it is drawn with, is
decided here, next to the verifier that will judge it:

- greedy: the argmax of the draft logits;
- coupled: drawn from the draft distribution with the very noise the verifier samples that output
  position with (keyed by (seed, output index), PositionMetadata), so a draft equal to the target's
  sample is accepted by matching;
- independent: drawn from the draft distribution q with fresh noise from the default generator, q
  kept for the standard rejection sampler (Verifier._verify_independent).

The C++ draft chain (CausalLM.fused_drafts) takes the same noise as arguments (`*_chain_args`).
"""
from __future__ import annotations

import torch

from worker import fused_ops
from worker.models.llama import CausalLM
from worker.sample.sampler import Sampler, SamplingMetadata


def greedy_draft_tokens(model: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """compute_draft_logits(hidden).argmax(-1) as int32, without spreading a draft
    vocabulary's logits over the whole one (its ids are sorted: ties go to the lowest id alike)."""
    best = fused_ops.argmax(model.draft_head_logits(hidden))
    return (best if model.draft_vocab is None else model.draft_vocab[best]).to(torch.int32)


def pick_draft_tokens(model: CausalLM, sampler: Sampler, hidden: torch.Tensor, meta: SamplingMetadata | None,
                      allowed: torch.Tensor | None = None) -> torch.Tensor:
    """One draft per row from the MTP hidden states (int32 token ids): the argmax where `meta` is
    None, else drawn as `meta` says (its keyed generators: coupled draws); `allowed` [rows, V]:
    the tokens a grammar allows (a draft it refuses could never be accepted)."""
    if meta is None and allowed is None:
        return greedy_draft_tokens(model, hidden)
    logits = model.compute_draft_logits(hidden)
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    if meta is None:
        return fused_ops.argmax(logits).to(torch.int32)
    return sampler(logits, meta).sampled_token_ids


def independent_chain_args(model: CausalLM, sampler: Sampler, temperatures: list[float], k: int,
                           device: torch.device) -> dict:
    """CausalLM.fused_drafts' arguments for drafts drawn independently from q: one uniform a draft
    from the default generator, the rows' inverse temperatures, and the buffer q is written to."""
    gen = sampler.default_generator(device)
    return {"noise": torch.rand(len(temperatures), k, 1, generator=gen, device=device),
            "inv_temp": torch.tensor([1.0 / t for t in temperatures], dtype=torch.float32, device=device),
            "draft_probs": torch.empty(len(temperatures), k, model.draft_head.out_features, device=device)}


def coupled_chain_args(model: CausalLM, metas: list[SamplingMetadata | None], device: torch.device) -> dict | None:
    """CausalLM.fused_drafts' arguments for the drafts of `metas` (one per draft j, rows alike):
    {} for argmax; for coupled draws, the uniforms each draft's output position is verified with
    and the rows' inverse temperatures; None where the chain cannot draw them (a row greedy among
    random ones, top-k, top-p, min-p, a min_tokens ban: pick_draft_tokens handles those)."""
    if metas[0] is None:
        return {}
    if not all(m.no_greedy and m.no_top_k and m.no_top_p and m.no_min_p and m.banned_token_ids is None
               for m in metas):
        return None
    noise = torch.empty(metas[0].num_rows, len(metas), model.config.vocab_size, device=device)
    for j, m in enumerate(metas):
        for r, gen in enumerate(m.generators):
            noise[r, j].uniform_(generator=gen)  # the draws the verifier makes for that position
    return {"noise": noise, "inv_temp": 1.0 / metas[0].temperature.float()}
