"""Speculative decoding: drafters, the policy that picks how many drafts, and their wiring.

- drafter.py: `Drafts` (what a proposal returns) and the `Drafter` protocol;
- mtp.py: the MTP drafter (the model's own next-token-prediction layer, run recursively);
- ngram.py: prompt lookup, the weight-free fallback;
- policy.py: how many drafts each step (0..K), from measured acceptance and step cost;
- speculator.py: choose k -> propose -> keep the drafts -> feed the policy the step's outcome.

Verifying drafts is sampling: worker/sample/verifier.py.
"""
