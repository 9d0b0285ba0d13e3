"""Tests for worker.sample.sampler: penalties, bans, greedy, distribution filters, seeding, logprobs.

Distribution tests compare against a numpy (float64) reference in tests/distributions.py,
independently of the sampler's torch code, and use a fixed sampler seed so the
chi-square outcome is deterministic.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from distributions import assert_matches_distribution, reference_probs

from worker.sample.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    make_generator,
)

VOCAB = 24


# ----------------------------------------------------------------- helpers


def fixed_logits(seed: int = 0, vocab: int = VOCAB, scale: float = 1.5) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, scale, size=vocab).astype(np.float32)


def meta_for(rows: int, **per_row_scalars) -> SamplingMetadata:
    """Metadata where every row has the same settings (given as scalars)."""
    max_num_logprobs = per_row_scalars.pop("max_num_logprobs", -1)
    temperature = per_row_scalars.pop("temperature", 1.0)
    lists = {k: [v] * rows for k, v in per_row_scalars.items()}
    return SamplingMetadata.from_lists([temperature] * rows, max_num_logprobs=max_num_logprobs, **lists)


# ----------------------------------------------------------------- greedy


def test_greedy_equals_argmax() -> None:
    logits = torch.randn(64, 100, generator=make_generator(0))
    meta = meta_for(64, temperature=0.0)
    assert meta.all_greedy
    out = Sampler(seed=0)(logits, meta)
    assert isinstance(out, SamplerOutput)
    assert out.sampled_token_ids.dtype == torch.int32
    assert out.logprobs is None
    assert torch.equal(out.sampled_token_ids.long(), logits.argmax(-1))


def test_greedy_rows_in_mixed_batch_ignore_filters_and_randomness() -> None:
    logits = torch.randn(6, 50, generator=make_generator(1))
    # Greedy rows carry random-looking settings too: they must still be argmax.
    meta = SamplingMetadata.from_lists(
        [0.0, 1.0, 0.0, 0.8, 0.0, 1.3],
        top_k=[3, 5, 0, 0, 2, 0],
        top_p=[0.5, 1.0, 0.9, 0.8, 1.0, 1.0],
        generators=[make_generator(7), None, None, make_generator(8), None, None],
    )
    assert not meta.all_greedy
    out = Sampler(seed=0)(logits, meta)
    greedy_rows = [0, 2, 4]
    assert torch.equal(out.sampled_token_ids[greedy_rows].long(), logits[greedy_rows].argmax(-1))
    probs = Sampler().compute_probs(logits, meta)
    assert torch.equal(probs[greedy_rows], torch.nn.functional.one_hot(logits[greedy_rows].argmax(-1), 50).float())
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))


def test_bf16_logits_accepted() -> None:
    logits = torch.randn(4, 32, generator=make_generator(2)).to(torch.bfloat16)
    out = Sampler(seed=0)(logits, meta_for(4, temperature=0.0, max_num_logprobs=2))
    assert torch.equal(out.sampled_token_ids.long(), logits.float().argmax(-1))
    assert out.logprobs is not None and out.logprobs.logprobs.dtype == torch.float32


# ----------------------------------------------------------------- penalties and bans

BASE = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([BASE] * 4)
    meta = SamplingMetadata.from_lists(
        [1.0] * 4,
        repetition_penalty=[2.0, 1.0, 1.0, 1.0],
        frequency_penalty=[0.0, 0.5, 0.0, 0.0],
        presence_penalty=[0.0, 0.0, 0.75, 0.0],
        # Row 0: repetition covers prompt AND output (set semantics, counts irrelevant).
        # Rows 1-2: frequency/presence look at the OUTPUT only (prompt token 0 untouched).
        # -1 is a placeholder id and must be ignored, not wrap around.
        prompt_token_ids=[[0, 1], [0], [0], [0, 3]],
        output_token_ids=[[1, 4, 4, -1], [3, 3, 3, 2], [3, 3, 2], [3]],
    )
    before = logits.clone()
    out = Sampler().apply_penalties_and_bans(logits, meta)
    expected = torch.tensor(
        [
            # repetition 2.0 on {0, 1, 4}: positive logits divided, negative multiplied
            [1.0, -2.0, 0.5, 3.0, -4.0, 0.0],
            # frequency 0.5: token 3 seen 3x -> -1.5, token 2 once -> -0.5
            [2.0, -1.0, 0.0, 1.5, -2.0, 0.0],
            # presence 0.75: tokens 2 and 3 present -> -0.75 each regardless of count
            [2.0, -1.0, -0.25, 2.25, -2.0, 0.0],
            # all penalties off for this row
            BASE,
        ]
    )
    torch.testing.assert_close(out, expected)
    assert torch.equal(logits, before), "the caller's logits must not be modified"


def test_penalties_combined_on_one_row() -> None:
    logits = torch.tensor([BASE])
    meta = SamplingMetadata.from_lists(
        [1.0],
        repetition_penalty=[1.25],
        frequency_penalty=[0.5],
        presence_penalty=[0.25],
        prompt_token_ids=[[3]],
        output_token_ids=[[1, 1, 5]],
    )
    out = Sampler().apply_penalties_and_bans(logits, meta)
    # token 1: -1 * 1.25 - 0.5*2 - 0.25 = -2.5; token 3: 3/1.25 = 2.4 (prompt only);
    # token 5: 0.0 * 1.25 - 0.5 - 0.25 = -0.75
    torch.testing.assert_close(out, torch.tensor([[2.0, -2.5, 0.5, 2.4, -2.0, -0.75]]))


def test_greedy_uses_penalised_logits() -> None:
    logits = torch.tensor([BASE])
    meta = SamplingMetadata.from_lists(
        [0.0], presence_penalty=[2.0], prompt_token_ids=[[]], output_token_ids=[[3]]
    )
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [0]  # 3.0 - 2 = 1.0 < 2.0


def test_banned_tokens_never_sampled() -> None:
    rows = 4000
    logits = torch.tensor(fixed_logits(3)).repeat(rows, 1)
    logits[:, 5] = 10.0  # by far the most likely token...
    banned = [[5, 7]] * rows  # ...is banned, together with another
    meta = SamplingMetadata.from_lists([1.0] * rows, banned_token_ids=banned, max_num_logprobs=0)
    out = Sampler(seed=0)(logits, meta)
    drawn = set(out.sampled_token_ids.tolist())
    assert not drawn & {5, 7}
    assert len(drawn) > 5  # still a real distribution over the rest
    # Logprobs stay those of the raw model, bans included.
    assert out.logprobs is not None
    torch.testing.assert_close(
        out.logprobs.logprobs[:, 0],
        torch.log_softmax(logits, -1).gather(1, out.sampled_token_ids.long()[:, None])[:, 0],
    )
    greedy = Sampler()(logits[:2], SamplingMetadata.from_lists([0.0, 0.0], banned_token_ids=[[5], []]))
    runner_up = int(logits[0].clone().index_fill_(0, torch.tensor([5]), float("-inf")).argmax())
    assert greedy.sampled_token_ids.tolist() == [runner_up, 5]


# ----------------------------------------------------------------- distributions

DIST_CASES = {
    "temperature_1.0": dict(temperature=1.0),
    "temperature_0.7": dict(temperature=0.7),
    "top_k": dict(temperature=1.0, top_k=5),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.1),
    "combined": dict(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("case", list(DIST_CASES))
def test_distribution_matches_reference(case: str) -> None:
    params = DIST_CASES[case]
    raw = fixed_logits(0)
    ref = reference_probs(raw, **params)
    n = 30_000
    meta = meta_for(n, **params)
    logits = torch.from_numpy(raw).repeat(n, 1)

    sampler = Sampler(seed=1234)
    # The target distribution itself, exactly.
    probs = sampler.compute_probs(logits[:2], meta.select_rows([0, 1]))
    np.testing.assert_allclose(probs[0].double().numpy(), ref, atol=1e-6)
    # And what actually gets sampled.
    samples = sampler(logits, meta).sampled_token_ids.numpy()
    assert_matches_distribution(samples, ref)


def test_mixed_batch_each_row_follows_its_own_settings() -> None:
    """All cases interleaved in one batch (plus greedy rows): per-row settings must not leak."""
    raw = fixed_logits(0)
    cases = list(DIST_CASES.values()) + [dict(temperature=0.0)]
    per_case = 10_000
    rows = [cases[i % len(cases)] for i in range(per_case * len(cases))]
    meta = SamplingMetadata.from_lists(
        [r["temperature"] for r in rows],
        top_k=[r.get("top_k", 0) for r in rows],
        top_p=[r.get("top_p", 1.0) for r in rows],
        min_p=[r.get("min_p", 0.0) for r in rows],
    )
    samples = Sampler(seed=99)(torch.from_numpy(raw).repeat(len(rows), 1), meta).sampled_token_ids.numpy()
    for c, params in enumerate(cases):
        mine = samples[c :: len(cases)]
        if params["temperature"] == 0.0:
            assert (mine == int(raw.argmax())).all()
        else:
            assert_matches_distribution(mine, reference_probs(raw, **params))


def test_seeded_rows_follow_the_distribution() -> None:
    """The per-row generator path (one draw per row) is as exact as the batched one."""
    raw = fixed_logits(1)
    params = dict(temperature=0.9, top_p=0.95)
    n = 6_000
    meta = SamplingMetadata.from_lists(
        [params["temperature"]] * n, top_p=[params["top_p"]] * n,
        generators=[make_generator(10_000 + i) for i in range(n)],
    )
    samples = Sampler()(torch.from_numpy(raw).repeat(n, 1), meta).sampled_token_ids.numpy()
    assert_matches_distribution(samples, reference_probs(raw, **params))


def test_sample_from_probs_respects_support() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0], [0.2, 0.0, 0.0, 0.2]]).repeat(500, 1)
    meta = meta_for(probs.shape[0])
    tokens = Sampler(seed=5).sample_from_probs(probs, meta).view(500, 3)
    assert set(tokens[:, 0].tolist()) == {1, 3}
    assert set(tokens[:, 1].tolist()) == {2}
    assert set(tokens[:, 2].tolist()) == {0, 3}  # unnormalised rows are fine


def test_an_unkeyed_draw_at_the_top_of_its_uniform_never_picks_a_token_of_zero_mass(monkeypatch) -> None:
    """Rows without a generator draw by inverse CDF with one uniform: even a uniform at (or rounded
    to) the top of [0, 1) lands on the last token of nonzero mass, never on a banned one after it."""
    probs = torch.tensor([[0.2, 0.8, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [1e-3, 0.0, 0.0, 0.0]])
    for u in (1.0 - 2.0**-24, 1.0):
        monkeypatch.setattr(torch, "rand", lambda *size, u=u, **kwargs: torch.full(size, u))
        assert Sampler(seed=0).sample_from_probs(probs, meta_for(3)).tolist() == [1, 2, 0]


# ----------------------------------------------------------------- seeding


def _run_seeded_row(
    seed: int, step_logits: list[torch.Tensor], batch_size: int, position: int, other_seed_base: int | None
) -> list[int]:
    """Sample the row of interest for len(step_logits) steps inside a batch of strangers."""
    target_gen = make_generator(seed)
    # Other rows: a mix of seeded, unseeded and greedy neighbours with their own settings.
    others: list[torch.Generator | None] = [
        None if other_seed_base is None or i % 3 == 0 else make_generator(other_seed_base + i)
        for i in range(batch_size - 1)
    ]
    other_temps = [0.0 if i % 4 == 1 else 1.1 for i in range(batch_size - 1)]
    sampler = Sampler(seed=None if other_seed_base is None else other_seed_base)
    noise_gen = make_generator(1000 + batch_size + position)
    tokens = []
    for logits_row in step_logits:
        gens = others[:position] + [target_gen] + others[position:]
        temps = other_temps[:position] + [0.8] + other_temps[position:]
        top_p = [0.7] * position + [0.95] + [0.7] * (batch_size - 1 - position)
        logits = torch.randn(batch_size, logits_row.shape[0], generator=noise_gen)
        logits[position] = logits_row
        meta = SamplingMetadata.from_lists(temps, top_p=top_p, generators=gens)
        tokens.append(int(sampler(logits, meta).sampled_token_ids[position]))
    return tokens


def test_seeded_row_is_reproducible_and_batch_independent() -> None:
    vocab = 500
    gen = make_generator(123)
    step_logits = [torch.randn(vocab, generator=gen) * 0.5 for _ in range(25)]
    reference = _run_seeded_row(42, step_logits, batch_size=1, position=0, other_seed_base=None)
    assert len(set(reference)) > 5  # a real random sequence, not a constant
    for batch_size, position, other_seed_base in [(1, 0, 7), (5, 0, 3), (5, 4, None), (17, 8, 11), (33, 20, 12345)]:
        got = _run_seeded_row(42, step_logits, batch_size, position, other_seed_base)
        assert got == reference, f"batch={batch_size} pos={position} others={other_seed_base}"
    assert _run_seeded_row(43, step_logits, batch_size=1, position=0, other_seed_base=None) != reference


def test_same_sampler_seed_reproduces_unseeded_rows() -> None:
    logits = torch.randn(64, 40, generator=make_generator(4))
    meta = meta_for(64, temperature=1.0, top_k=20)
    a = Sampler(seed=77)(logits, meta).sampled_token_ids
    b = Sampler(seed=77)(logits, meta).sampled_token_ids
    assert torch.equal(a, b)


# ----------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_ranked() -> None:
    batch, vocab, n = 8, 50, 5
    logits = torch.randn(batch, vocab, generator=make_generator(6)) * 2
    meta = SamplingMetadata.from_lists(
        [0.0, 0.5, 1.0, 1.5, 0.0, 1.0, 2.0, 1.0],
        repetition_penalty=[1.5] * batch,
        frequency_penalty=[0.3] * batch,
        prompt_token_ids=[[1, 2, 3]] * batch,
        output_token_ids=[list(logits[i].topk(2).indices.tolist()) for i in range(batch)],
        max_num_logprobs=n,
    )
    out = Sampler(seed=3)(logits, meta)
    lp = out.logprobs
    assert isinstance(lp, LogprobsTensors)
    assert lp.token_ids.shape == (batch, 1 + n) and lp.token_ids.dtype == torch.int32
    assert lp.logprobs.shape == (batch, 1 + n) and lp.logprobs.dtype == torch.float32
    assert lp.ranks.shape == (batch,) and lp.ranks.dtype == torch.int32

    raw = torch.log_softmax(logits, -1)
    sampled = out.sampled_token_ids.long()
    assert torch.equal(lp.token_ids[:, 0].long(), sampled)
    torch.testing.assert_close(lp.logprobs, raw.gather(1, lp.token_ids.long()))
    # Top-n: the n most likely raw tokens, best first.
    assert torch.equal(lp.token_ids[:, 1:].long(), raw.argsort(-1, descending=True)[:, :n])
    assert (lp.logprobs[:, 1:].diff(dim=-1) <= 0).all()
    raw_np = raw.numpy()
    for i in range(batch):
        expected_rank = 1 + int((raw_np[i] > raw_np[i, sampled[i]]).sum())
        assert int(lp.ranks[i]) == expected_rank
    # Penalties pushed the raw top-2 down, so at least one greedy row did not pick rank 1.
    assert int(lp.ranks[0]) > 1 or int(lp.ranks[4]) > 1


def test_logprobs_zero_and_off() -> None:
    logits = torch.randn(3, 20, generator=make_generator(8))
    out0 = Sampler(seed=0)(logits, meta_for(3, temperature=0.0, max_num_logprobs=0))
    assert out0.logprobs is not None
    assert out0.logprobs.token_ids.shape == (3, 1)
    assert out0.logprobs.ranks.tolist() == [1, 1, 1]
    torch.testing.assert_close(out0.logprobs.logprobs[:, 0], torch.log_softmax(logits, -1).max(-1).values)
    assert Sampler(seed=0)(logits, meta_for(3, max_num_logprobs=-1)).logprobs is None


def test_metadata_validation_errors() -> None:
    with pytest.raises(ValueError, match="per-row values"):
        SamplingMetadata.from_lists([1.0, 1.0], top_k=[1])
    meta = meta_for(2)
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(3, 5), meta)
    pen = SamplingMetadata.from_lists([1.0], presence_penalty=[0.5])
    with pytest.raises(ValueError, match="output_token_ids"):
        Sampler()(torch.zeros(1, 5), pen)


def test_flags_inferred_from_tensors() -> None:
    """Metadata built directly from tensors (as the runner does) derives the skip flags."""
    b = 3
    meta = SamplingMetadata(
        temperature=torch.tensor([1.0, 0.0, 0.7]),
        top_k=torch.zeros(b, dtype=torch.int32),
        top_p=torch.tensor([1.0, 1.0, 0.9]),
        min_p=torch.zeros(b),
        generators=[None] * b,
        repetition_penalty=torch.ones(b),
        frequency_penalty=torch.zeros(b),
        presence_penalty=torch.zeros(b),
        prompt_token_ids=None,
        output_token_ids=None,
        banned_token_ids=None,
        max_num_logprobs=-1,
        all_greedy=False,
    )
    assert meta.no_penalties and meta.no_top_k and meta.no_min_p and not meta.no_top_p
    out = Sampler(seed=0)(torch.randn(b, 10, generator=make_generator(9)), meta)
    assert out.sampled_token_ids.shape == (b,)
