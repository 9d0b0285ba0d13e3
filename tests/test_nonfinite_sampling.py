"""Non-finite sampling inputs never yield a token outside [0, vocab), in every sampling path (issue 45).

The rule (worker/fused_ops.py): NaN logits count as -inf, +inf ones as the largest float32
(tokens at +inf share the mass), after penalties and temperature; a row with no finite logit
gives token 0. Each test feeds rows of NaN, +inf, -inf and mixes of them, alone and beside
ordinary rows, to one path: the sampler's greedy, unkeyed and seeded draws (with filters,
penalties and a grammar mask), the torch rejection sampler, the C++ rejection_verify and its torch
reference (which the plain-random fast path uses with no drafts), the MTP drafting chain in C++,
and a whole engine whose model returns such logits.
"""
from __future__ import annotations

import math

import pytest
import torch
from conftest import bf16_drafter_with_draft_vocab, random_prompts
from reference_rejection_sampler import RejectionSampler

from engine import LLM, SamplingParams
from worker import fused_ops
from worker.sample.sampler import Sampler, SamplingMetadata, make_generator

V = 40
NAN, INF = float("nan"), float("inf")


def hostile_logits(seed: int = 0) -> tuple[torch.Tensor, list[set[int] | None]]:
    """Rows of non-finite logits, and per row the tokens the rule allows (None: any finite-logit token)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, V, generator=g)
    allowed: list[set[int] | None] = [None] * 8
    x[0] = NAN                                   # nothing finite: token 0
    allowed[0] = {0}
    x[1] = -INF
    allowed[1] = {0}
    x[2, ::2] = NAN                              # NaN among finite: never a NaN token
    allowed[2] = set(range(1, V, 2))
    x[3, 5] = x[3, 17] = INF                     # +inf tokens take all the mass
    allowed[3] = {5, 17}
    x[4] = -INF
    x[4, 9] = NAN
    allowed[4] = {0}
    x[5] = NAN
    x[5, 33] = 1.0                               # one finite token among NaN
    allowed[5] = {33}
    x[6, 3] = INF
    x[6, 4] = NAN                                # +inf wins over NaN
    allowed[6] = {3}
    return x, allowed                            # row 7: ordinary logits


def check(tokens: torch.Tensor | list[int], allowed: list[set[int] | None]) -> None:
    tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    for row, (t, ok) in enumerate(zip(tokens, allowed)):
        assert 0 <= t < V, f"row {row}: token {t} outside [0, {V})"
        if ok is not None:
            assert t in ok, f"row {row}: token {t}, the rule allows {sorted(ok)}"


SETTINGS = {
    "greedy": dict(temperature=0.0),
    "random": dict(temperature=1.0),
    "seeded": dict(temperature=0.8, seeded=True),
    "filters": dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
    "tiny temperature": dict(temperature=1e-5),
    "huge temperature": dict(temperature=1e39),        # inf in float32: what the API refuses
    "tiny penalty": dict(temperature=1.0, repetition_penalty=1e-40),  # 0 in float32: likewise
}


# The torch paths on a GPU too, where there is one (the C++ ops are CPU-only).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def meta_for(rows: int, temperature: float, seeded: bool = False, repetition_penalty: float = 1.0,
             device: str = "cpu", **filters) -> SamplingMetadata:
    gens = [make_generator(100 + r, device) for r in range(rows)] if seeded else None
    lists = {k: [v] * rows for k, v in filters.items()}
    return SamplingMetadata.from_lists([temperature] * rows, generators=gens,
                                       repetition_penalty=[repetition_penalty] * rows,
                                       prompt_token_ids=[[1, 2, 3, 5]] * rows, output_token_ids=[[3, 7]] * rows,
                                       max_num_logprobs=2, device=device, **lists)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampler_paths_stay_in_vocab(setting, device):
    logits, allowed = hostile_logits()
    logits = logits.to(device)
    settings = dict(SETTINGS[setting])
    if setting in ("huge temperature", "tiny penalty"):
        # softmax(x / inf) is uniform over the finite logits; a zero penalty multiplies seen
        # negative logits by 0 and divides positive ones to +inf: only the range is asserted
        allowed = [None] * len(allowed)
    sampler = Sampler(seed=1, device=device)
    for _ in range(20):
        out = sampler(logits, meta_for(logits.shape[0], device=device, **settings))
        check(out.sampled_token_ids, allowed)
        assert out.logprobs.token_ids.min() >= 0 and out.logprobs.token_ids.max() < V


def test_grammar_masked_rows_stay_in_vocab_and_in_the_mask():
    logits, allowed = hostile_logits(1)
    mask = torch.zeros_like(logits, dtype=torch.bool)
    mask[:, 10:20] = True
    mask[3, 5] = True                                  # +inf token 5 allowed, 17 not
    meta = meta_for(logits.shape[0], 1.0)
    meta.allowed_token_mask = mask
    want = [{0}, {0}, {11, 13, 15, 17, 19}, {5, 17}, {0}, {0}, set(range(10, 20)), set(range(10, 20))]
    sampler = Sampler(seed=2)
    for _ in range(20):
        check(sampler(logits, meta).sampled_token_ids, want)


def test_sample_from_probs_with_nan_probabilities():
    """NaN handed in as probabilities (no caller of the engine does: compute_probs never makes them)."""
    probs = torch.rand(4, V)
    probs[0] = NAN
    probs[1, 7] = NAN
    probs[2] = 0.0
    for seeded in (False, True):
        tokens = Sampler(seed=3).sample_from_probs(probs, meta_for(4, 1.0, seeded=seeded))
        assert ((tokens >= 0) & (tokens < V)).all()


@pytest.mark.parametrize("setting", ["greedy", "random", "seeded"])
@pytest.mark.parametrize("explicit_q", [False, True])
def test_rejection_sampler_stays_in_vocab(setting, explicit_q):
    """Three requests with 2 drafts each over the hostile rows, plus one without drafts."""
    logits, _ = hostile_logits(2)
    logits = torch.cat([logits, logits[:2]])
    ks = [2, 2, 2, 0]
    drafts = [[0, 2], [5, 33], [3, 9], []]
    q = torch.softmax(torch.randn(6, V), dim=-1) if explicit_q else None
    meta = meta_for(4, **SETTINGS[setting])
    meta.max_num_logprobs = -1
    rows = RejectionSampler(Sampler(seed=4))(logits, ks, drafts, q, meta)
    for toks in rows.accepted_token_ids:
        assert all(0 <= t < V for t in toks), rows.accepted_token_ids


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.05, math.inf])
def test_rejection_verify_stays_in_vocab(fused, temperature, monkeypatch):
    """fused_ops.rejection_verify (C++ and its torch reference): with 1 draft a row, and with none
    (the plain-random fast path, _sample_plain_random)."""
    if fused:
        assert fused_ops.enable()
    else:
        monkeypatch.setattr(fused_ops, "_enabled", False)
    logits, allowed = hostile_logits(3)
    temps = torch.full((8,), temperature)
    u = torch.rand(8, generator=torch.Generator().manual_seed(5))
    no_drafts = torch.empty(0, dtype=torch.int32)
    plain = fused_ops.rejection_verify(logits, temps, torch.zeros(8, dtype=torch.int32), no_drafts,
                                       torch.empty(0, 0), None, torch.empty(0), u)
    check(plain[:, 1], allowed if temperature != math.inf else [None] * 8)
    # Row r verifies draft r against logits rows 2r (the draft) and 2r + 1 (the bonus).
    pairs = torch.cat([logits, logits.flip(0)]).reshape(2, 8, V).transpose(0, 1).reshape(16, V).contiguous()
    q = torch.softmax(torch.randn(8, V), dim=-1)
    drafts = torch.tensor([0, 2, 5, 3, 9, 33, 3, 1], dtype=torch.int32)
    out = fused_ops.rejection_verify(pairs, temps[:8], torch.ones(8, dtype=torch.int32), drafts, q, None,
                                     torch.rand(8), u)
    assert ((out[:, 1] >= 0) & (out[:, 1] < V)).all() and ((out[:, 0] >= 0) & (out[:, 0] <= 1)).all()


@pytest.mark.parametrize("mode", ["greedy", "coupled", "independent"])
def test_mtp_draft_chain_stays_in_the_draft_vocabulary(mtp_checkpoints, tmp_path, mode):
    """The C++ MTP chain (mtp_draft) over hidden states of NaN, +inf and -inf: every draft is a token of
    the draft vocabulary, and an independent draft's q is a distribution (a point mass where the
    draft head has no finite logit)."""

    llm = bf16_drafter_with_draft_vocab(mtp_checkpoints["qwen2"], tmp_path)
    runner = llm.engine.runner
    model, (k_cache, v_cache) = runner.model, runner.kv_views[-1]
    rows, k = 4, 2
    h = torch.randn(rows, model.config.hidden_size)
    h[0], h[1, ::2], h[2], h[3, 0] = NAN, NAN, INF, -INF
    args = {}
    if mode == "coupled":
        args = dict(noise=torch.rand(rows, k, model.config.vocab_size), inv_temp=torch.full((rows,), 1.0))
    elif mode == "independent":
        args = dict(noise=torch.rand(rows, k, 1), inv_temp=torch.full((rows,), 1.0),
                    draft_probs=torch.empty(rows, k, len(model.draft_vocab)))
    with torch.inference_mode():
        drafts = model.fused_drafts(h, torch.full((rows,), 7, dtype=torch.long), k, k_cache, v_cache,
                                    torch.zeros(rows, 4, dtype=torch.int32), 4, None, **args)
    assert drafts is not None
    assert set(drafts.flatten().tolist()) <= set(model.draft_vocab.tolist())
    if mode == "independent":
        q = args["draft_probs"]
        assert torch.isfinite(q).all() and (q >= 0).all()
        torch.testing.assert_close(q.sum(-1), torch.ones(rows, k))
    llm.shutdown()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=7, max_tokens=6, min_tokens=3),
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1),
], ids=["greedy", "random", "seeded-min-tokens", "greedy-logprobs"])
def test_an_engine_whose_model_returns_nan_logits_keeps_serving(mtp_checkpoints, monkeypatch, params):
    """Every verified position's logits NaN (MTP on: plain-greedy, plain-random and verify paths):
    the requests get token 0 (nothing is finite), and once the model is sane again a request
    gives what it gives on a fresh engine."""
    llm = LLM(str(mtp_checkpoints["qwen2"]), max_model_len=64, max_num_seqs=2, block_size=4,
              speculative_method="mtp", num_speculative_tokens=2)
    prompt = random_prompts(1, 9, 9, 384, 2)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = llm.generate([prompt], greedy)[0].token_ids
    model = llm.engine.runner.model
    original = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda hidden: original(hidden) * NAN)
    out = llm.generate([prompt, prompt], params)
    assert all(o.token_ids and set(o.token_ids) == {0} for o in out), [o.token_ids for o in out]
    monkeypatch.undo()
    assert llm.generate([prompt], greedy)[0].token_ids == before
    llm.shutdown()
