"""Sampling: every way a token is chosen, for the target (verifier.py) and for the drafter (draft.py).

- sampler.py: the token sampler over logits (penalties, bans, temperature, top-k/p, min-p, seeded
  and keyed noise, logprobs) and the generators keyed by (seed, output index);
- metadata.py: the per-position sampling settings built from the request-state slots;
- verifier.py: `Verifier.sample(batch, hidden) -> StepTokens`, a step's tokens (plain greedy, the
  C++ plain-random draw, seeded, grammar-masked, drafts verified by matching or by rejection);
- matching.py: verification by matching the target's own samples;
- draft.py: how a drafter picks its draft tokens, and the noise it draws them with.

No module outside this package samples a token (tests/test_layout.py).
"""
