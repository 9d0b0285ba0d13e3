"""Speculative sampling preserves the target distribution, end to end (issue: MTP).

A small-vocab model with a random MTP layer (so drafts are both accepted and rejected): the
joint distribution of the first generated tokens over many seeded requests must be the same
with MTP speculation as without (two-sample chi-square), at temperature 1 and with top-p.
"""
from __future__ import annotations

import collections
import json

import pytest
from conftest import add_mtp_layer, make_small_vocab_checkpoint
from scipy.stats import chi2_contingency

from engine import LLM, SamplingParams

N = 2500


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    return add_mtp_layer(make_small_vocab_checkpoint(tmp_path_factory.mktemp("smallvocab"), seed=3), seed=6, std=0.5)


def sample_counts(model, spec: bool, top_p: float, draft_vocab: str = "auto",
                  seeded: bool = True) -> tuple[collections.Counter, float]:
    kwargs = dict(speculative_method="mtp", num_speculative_tokens=2, draft_vocab=draft_vocab) if spec else {}
    llm = LLM(str(model), max_model_len=32, max_num_seqs=128, **kwargs)
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=s + (10**6 if spec else 0) if seeded else None,
                             max_tokens=4, ignore_eos=True) for s in range(N)]
    outs = llm.generate([[1, 2, 3]] * N, params)
    spec_stats = llm.engine.scheduler.spec_stats
    accept = spec_stats.num_accepted_tokens / max(1, spec_stats.num_draft_tokens)
    # Tokens 2-4 are the ones produced by verify steps when speculating.
    return collections.Counter(tuple(o.token_ids[1:4]) for o in outs), accept


@pytest.mark.parametrize("top_p,subset,seeded", [(1.0, None, True), (0.8, None, True), (1.0, [0, 2, 3, 5], True),
                                                 (1.0, None, False), (1.0, [0, 2, 3, 5], False)])
def test_spec_sampling_matches_non_spec_distribution(small_vocab_model, top_p, subset, seeded, tmp_path,
                                                     monkeypatch):
    """`subset`: drafts over those tokens only (--draft-vocab): the masked draft distribution is
    what the drafts are drawn from and what the rejection sampler is told, so the output keeps the
    target's distribution although two tokens can never be drafted. Seeded requests draw coupled
    drafts (verified by matching the target's keyed samples); unseeded ones at plain temperature
    draw independent drafts, verified by the standard rejection sampler with their q."""
    from worker.sample.verifier import Verifier

    vocab = "auto"
    if subset is not None:
        vocab = str(tmp_path / "draft_vocab.json")
        (tmp_path / "draft_vocab.json").write_text(json.dumps({"token_ids": subset}))
    verified = collections.Counter()

    def counted(name: str):
        original = getattr(Verifier, name)

        def counting(self, logits, *args):
            verified[name] += logits.shape[0]
            return original(self, logits, *args)
        return counting

    for name in ("_verify_independent", "_verify_matching"):
        monkeypatch.setattr(Verifier, name, counted(name))
    base, _ = sample_counts(small_vocab_model, spec=False, top_p=top_p)
    verified.clear()
    spec, accept = sample_counts(small_vocab_model, spec=True, top_p=top_p, draft_vocab=vocab, seeded=seeded)
    independent = verified["_verify_independent"]
    if seeded or top_p < 1:
        assert independent == 0, verified
    else:  # (some steps verify no drafts: those sample by matching)
        assert independent > 2 * N, verified
    assert 0.1 < accept < 0.95, f"drafts should be partly accepted to exercise both paths, got {accept:.2f}"
    for pos in range(3):  # each position's marginal, then the pair (2, 3)
        a = collections.Counter(k[pos] for k in base.elements())
        b = collections.Counter(k[pos] for k in spec.elements())
        keys = sorted(set(a) | set(b))
        _, p, _, _ = chi2_contingency([[a[k] + 0.5 for k in keys], [b[k] + 0.5 for k in keys]])
        assert p > 1e-3, f"position {pos + 2}: spec vs non-spec differ (p={p:.2g})"
    pairs_a = collections.Counter(k[:2] for k in base.elements())
    pairs_b = collections.Counter(k[:2] for k in spec.elements())
    keys = [k for k in set(pairs_a) | set(pairs_b) if pairs_a[k] + pairs_b[k] >= 20]
    _, p, _, _ = chi2_contingency([[pairs_a[k] for k in keys], [pairs_b[k] for k in keys]])
    assert p > 1e-3, f"joint of tokens 2-3 differs (p={p:.2g})"


def test_a_batch_mixing_unseeded_seeded_and_greedy_rows():
    """Unseeded T=1 rows in one batch with greedy rows and a seeded T=1 row, on the bundled model:
    the drafter then draws every row's drafts coupled (one C++ call for the batch; a seeded row must
    not depend on how many drafts were verified when), so no row carries a q; the greedy rows are
    the non-speculative output token for token, and the seeded row is what it is alone."""
    from engine.config import DEFAULT_MODEL_DIR

    kwargs = dict(max_model_len=512, max_num_seqs=6)
    spec = LLM(str(DEFAULT_MODEL_DIR), speculative_method="mtp", num_speculative_tokens=2, spec_policy="fixed",
               **kwargs)
    openings = ["def __init__(self, name, value=None):\n", "import os\nimport sys\n\n\ndef main(", "class Queue:\n",
                "    for key, value in sorted(items.items()):\n", "def read_file(path):\n    with open(",
                "    if not isinstance(data, bytes):\n        raise TypeError("]
    prompts = [spec.tokenizer.encode(text) for text in openings]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    random = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=11)
    runner = spec.engine.runner
    propose, mixed_steps = runner.drafter.propose, []

    def watched(batch, *args):
        drafts = propose(batch, *args)
        if not runner.states.plain_random[batch.slots].all():  # a greedy or seeded row among them
            mixed_steps.append(drafts.probs is None)
        return drafts

    runner.drafter.propose = watched
    outs = spec.generate(prompts, [greedy, random, greedy, random, seeded, random])
    assert mixed_steps and all(mixed_steps)  # (once only unseeded rows are left, they may draw from q)
    assert spec.engine.scheduler.spec_stats.num_accepted_tokens > 0
    alone = spec.generate([prompts[4]], seeded)[0]
    assert outs[4].token_ids == alone.token_ids
    plain = LLM(str(DEFAULT_MODEL_DIR), **kwargs).generate([prompts[0], prompts[2]], greedy)
    assert [outs[0].token_ids, outs[2].token_ids] == [o.token_ids for o in plain]
