"""Tests for reference_rejection_sampler: greedy prefix matching, exact distribution preservation
of speculative rejection sampling, seeded reproducibility, and output-shape invariants.

Distribution tests put many identical requests in one batch (one call, many trials),
compare against a float64 numpy reference of the target distribution (tests/distributions.py),
and fix every seed so the chi-square outcomes are deterministic.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from distributions import CHI2_MIN_P_VALUE, assert_matches_distribution, reference_probs
from reference_rejection_sampler import RejectionOutput, RejectionSampler
from scipy import stats

from worker.sample.sampler import Sampler, SamplingMetadata, make_generator

# ----------------------------------------------------------------- helpers


def assert_binomial(successes: int, trials: int, prob: float, label: str = "") -> None:
    p_value = stats.binomtest(successes, trials, prob).pvalue
    assert p_value > CHI2_MIN_P_VALUE, f"{label}: {successes}/{trials} vs expected rate {prob:.4f} (p={p_value:.2e})"


def random_logits(rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=make_generator(seed)) * scale


def check_shape_invariants(out: RejectionOutput, ks: list[int], drafts: list[list[int]]) -> None:
    """Accepted drafts form a prefix, exactly one token follows, and it is never the rejected draft."""
    assert len(out.accepted_token_ids) == len(ks) == len(out.num_accepted_drafts)
    for b, (tokens, m, k) in enumerate(zip(out.accepted_token_ids, out.num_accepted_drafts, ks)):
        assert 0 <= m <= k, f"request {b}: {m} accepted of {k}"
        assert len(tokens) == m + 1, f"request {b}: {len(tokens)} tokens for {m} accepted drafts"
        assert tokens[:m] == drafts[b][:m]
        if m < k:
            assert tokens[m] != drafts[b][m], f"request {b}: the rejected draft {drafts[b][m]} was emitted"


# ----------------------------------------------------------------- greedy


def greedy_case(ks: list[int], matches: list[int], vocab: int, seed: int):
    """Logits and drafts whose first ``matches[b]`` drafts equal the target argmax, the next differs."""
    logits = random_logits(sum(ks) + len(ks), vocab, seed)
    argmax = logits.argmax(-1).tolist()
    rng = np.random.default_rng(seed)
    drafts, expected, row = [], [], 0
    for k, m in zip(ks, matches):
        assert 0 <= m <= k
        d = [argmax[row + j] for j in range(m)]
        if m < k:
            d.append((argmax[row + m] + 1 + int(rng.integers(vocab - 1))) % vocab)  # anything but the argmax
            d += [int(t) for t in rng.integers(vocab, size=k - m - 1)]
        drafts.append(d)
        expected.append(argmax[row:row + m + 1])
        row += k + 1
    return logits, drafts, expected


@pytest.mark.parametrize("explicit_q", [False, True])
def test_greedy_accepts_longest_matching_prefix(explicit_q: bool) -> None:
    ks = [0, 1, 3, 5, 4, 2, 1]
    matches = [0, 1, 0, 5, 2, 2, 0]  # includes all-accepted (bonus) rows and k = 0
    logits, drafts, expected = greedy_case(ks, matches, vocab=40, seed=3)
    # Greedy verification must ignore q entirely.
    q = torch.softmax(random_logits(sum(ks), 40, seed=4), -1) if explicit_q else None
    meta = SamplingMetadata.from_lists([0.0] * len(ks))
    out = RejectionSampler(Sampler(seed=0))(logits, ks, drafts, q, meta)
    assert out.num_accepted_drafts == matches
    assert out.accepted_token_ids == expected
    check_shape_invariants(out, ks, drafts)


def test_greedy_rows_in_mixed_batch() -> None:
    ks = [2, 3, 0, 4, 1, 3]
    matches = [1, 3, 0, 0, 1, 2]
    temps = [0.0, 0.9, 0.0, 1.0, 0.0, 0.0]
    logits, drafts, expected = greedy_case(ks, matches, vocab=30, seed=5)
    meta = SamplingMetadata.from_lists(
        temps, top_k=[3, 5, 2, 0, 0, 4], top_p=[0.7, 1.0, 0.5, 0.9, 1.0, 1.0],
        generators=[make_generator(1), None, None, make_generator(2), None, make_generator(3)],
    )
    assert not meta.all_greedy
    out = RejectionSampler(Sampler(seed=0))(logits, ks, drafts, None, meta)
    check_shape_invariants(out, ks, drafts)
    for b, t in enumerate(temps):
        if t == 0.0:
            assert out.num_accepted_drafts[b] == matches[b]
            assert out.accepted_token_ids[b] == expected[b]


def bigram_step_logits(table: torch.Tensor, prev_tokens: list[int]) -> torch.Tensor:
    """A toy 'target model': the logits after a token depend only on that token."""
    return table[torch.tensor(prev_tokens, dtype=torch.long)]


def test_speculative_greedy_with_penalties_and_bans_equals_plain_greedy() -> None:
    """Decode three requests to 30 tokens plainly and speculatively (noisy drafts, varying k):
    with repetition/frequency/presence penalties and bans the sequences must be identical,
    which needs each position penalised with the drafts before it as output context."""
    vocab, steps = 24, 30
    table = random_logits(vocab, vocab, seed=11, scale=1.0)
    prompts = [[3, 7, 7, 1], [0], [5, 9, 2, 2, 2]]
    settings = dict(repetition_penalty=[1.4, 1.0, 1.2], frequency_penalty=[0.3, 0.5, 0.0],
                    presence_penalty=[0.2, 0.0, 0.6], banned_token_ids=[[4], [], [4, 11]])
    n = len(prompts)

    def meta_for(outputs: list[list[int]]) -> SamplingMetadata:
        return SamplingMetadata.from_lists([0.0] * n, prompt_token_ids=prompts, output_token_ids=outputs,
                                           **settings)

    sampler = Sampler(seed=0)
    plain: list[list[int]] = [[] for _ in range(n)]
    for _ in range(steps):
        last = [(out or p)[-1] for out, p in zip(plain, prompts)]
        tokens = sampler(bigram_step_logits(table, last), meta_for(plain)).sampled_token_ids.tolist()
        for out, t in zip(plain, tokens):
            out.append(t)

    rng = np.random.default_rng(0)
    rejection = RejectionSampler(sampler)
    spec: list[list[int]] = [[] for _ in range(n)]
    total_accepted = total_rejected = 0
    while min(len(s) for s in spec) < steps:
        ks, drafts, rows = [], [], []
        for b in range(n):
            k = int(rng.integers(0, 5))
            # Drafts: the right continuation 70% of the time, a random (maybe banned) token otherwise.
            d = [plain[b][len(spec[b]) + j] if len(spec[b]) + j < steps and rng.random() < 0.7
                 else int(rng.integers(vocab)) for j in range(k)]
            ks.append(k)
            drafts.append(d)
            rows += [(spec[b] or prompts[b])[-1]] + d
        out = rejection(bigram_step_logits(table, rows), ks, drafts, None, meta_for(spec))
        check_shape_invariants(out, ks, drafts)
        for b in range(n):
            spec[b] += out.accepted_token_ids[b]
            total_accepted += out.num_accepted_drafts[b]
            total_rejected += int(out.num_accepted_drafts[b] < ks[b])
    assert total_accepted > 20 and total_rejected > 5  # both paths exercised
    assert [s[:steps] for s in spec] == plain
    for tokens, banned in zip(plain, settings["banned_token_ids"]):
        assert not set(tokens) & set(banned)


# ----------------------------------------------------------------- k = 0 and seeding


def test_rows_without_drafts_sample_like_the_plain_sampler() -> None:
    """k_b = 0 draws exactly what a plain Sampler step draws (same seeds, same default seed)."""
    vocab, n = 50, 6
    logits = random_logits(n, vocab, seed=21)
    seeds = [5, None, 6, None, 7, None]
    kwargs = dict(top_k=[0, 5, 0, 0, 8, 0], top_p=[1.0, 1.0, 0.8, 0.9, 1.0, 1.0], min_p=[0.0, 0.0, 0.0, 0.1, 0.0, 0.0])
    temps = [1.0, 0.7, 0.0, 1.3, 0.9, 1.0]

    def meta() -> SamplingMetadata:
        gens = [make_generator(s) if s is not None else None for s in seeds]
        return SamplingMetadata.from_lists(temps, generators=gens, **kwargs)

    for trial in range(3):
        plain = Sampler(seed=100 + trial)(logits, meta()).sampled_token_ids.tolist()
        out = RejectionSampler(Sampler(seed=100 + trial))(logits, [0] * n, [[] for _ in range(n)], None, meta())
        assert out.num_accepted_drafts == [0] * n
        assert out.accepted_token_ids == [[t] for t in plain]


@pytest.mark.parametrize("explicit_q", [False, True])
def test_a_batch_without_greedy_rows_skips_their_work_and_draws_the_same(explicit_q: bool) -> None:
    """`no_greedy` (set by the runner when every row samples) skips the argmax / one-hot that only
    greedy rows read: the same seeds give the same tokens and acceptances as the general path."""
    vocab, ks = 40, [3, 0, 2, 1]
    logits = random_logits(sum(ks) + len(ks), vocab, seed=31)
    q = torch.softmax(random_logits(sum(ks), vocab, seed=32), -1) if explicit_q else None
    drafts = [[1, 2, 3], [], [4, 5], [6]]
    temps, seeds = [1.0, 0.8, 1.2, 0.6], [11, 12, None, 14]

    def run(no_greedy: bool | None):
        gens = [make_generator(s) if s is not None else None for s in seeds]
        meta = SamplingMetadata.from_lists(temps, generators=gens, top_p=[1.0, 0.9, 1.0, 1.0])
        meta.no_greedy = no_greedy
        return RejectionSampler(Sampler(seed=7))(logits, ks, drafts, q, meta)

    assert SamplingMetadata.from_lists(temps).no_greedy and not SamplingMetadata.from_lists([1.0, 0.0]).no_greedy
    for _ in range(3):
        fast, general = run(True), run(False)
        assert fast.accepted_token_ids == general.accepted_token_ids
        assert fast.num_accepted_drafts == general.num_accepted_drafts


def seeded_request(seed: int, vocab: int = 20, k: int = 4):
    """A request whose drafts come from a q that differs from p, so both paths occur."""
    logits = random_logits(k + 1, vocab, seed=1000 + seed)
    # Draft logits = target logits + noise: close enough that drafts are often accepted.
    q = torch.softmax(logits[:k] + random_logits(k, vocab, seed=2000 + seed, scale=1.0), -1)
    drafts = torch.multinomial(q, 1, generator=make_generator(seed)).squeeze(1).tolist()
    return logits, q, drafts


@pytest.mark.parametrize("explicit_q", [False, True])
def test_seeded_output_independent_of_batch(explicit_q: bool) -> None:
    vocab, k = 20, 4
    others_logits = random_logits(3 + 2 + 4 + 1, vocab, seed=77)
    others_q = torch.softmax(random_logits(2 + 4, vocab, seed=78), -1)
    others_drafts = [[1, 2], [], [3, 4, 5, 6], []]
    accepted_counts = set()
    for seed in range(24):
        logits, q, drafts = seeded_request(seed, vocab, k)

        def meta(*with_others: bool, seed: int = seed) -> SamplingMetadata:
            own = dict(t=0.9, top_p=0.95, gen=make_generator(seed))
            rows = [own]
            if with_others:
                rows = [dict(t=1.0, top_p=1.0, gen=None), own, dict(t=0.0, top_p=1.0, gen=make_generator(9)),
                        dict(t=0.8, top_p=0.9, gen=make_generator(seed + 1)), dict(t=1.0, top_p=1.0, gen=None)]
            return SamplingMetadata.from_lists([r["t"] for r in rows], top_p=[r["top_p"] for r in rows],
                                               generators=[r["gen"] for r in rows])

        alone = RejectionSampler(Sampler(seed=1))(logits, [k], [drafts], q if explicit_q else None, meta())
        # In the batch: other requests before and after, a different default seed.
        ol = others_logits
        batch_logits = torch.cat([ol[:3], logits, ol[3:]])
        batch_q = torch.cat([others_q[:2], q, others_q[2:]])
        out = RejectionSampler(Sampler(seed=2))(
            batch_logits, [2, k, 0, 4, 0], [others_drafts[0], drafts] + others_drafts[1:],
            batch_q if explicit_q else None, meta(True),
        )
        assert out.accepted_token_ids[1] == alone.accepted_token_ids[0], f"seed {seed}"
        assert out.num_accepted_drafts[1] == alone.num_accepted_drafts[0]
        # And the same seed again gives the same answer.
        again = RejectionSampler(Sampler(seed=3))(logits, [k], [drafts], q if explicit_q else None, meta())
        assert again.accepted_token_ids == alone.accepted_token_ids
        accepted_counts.add(alone.num_accepted_drafts[0])
    assert len(accepted_counts) >= 3, f"seeds exercised too few outcomes: {accepted_counts}"


# ----------------------------------------------------------------- distribution preservation

DIST_VOCAB = 12
DIST_K = 2  # drafts per request: checks positions 0, 1 and the bonus at 2
DIST_TRIALS = 40000

TARGET_CONFIGS = {
    "T1": dict(temperature=1.0),
    "T1-top_p": dict(temperature=1.0, top_p=0.8),
    "T0.7-top_k-min_p": dict(temperature=0.7, top_k=8, min_p=0.05),
}


def draft_distribution(logits: np.ndarray, p: np.ndarray, seed: int) -> np.ndarray:
    """A q deliberately unlike p yet overlapping it enough to accept often: a flatter softmax of
    the unfiltered logits (mass outside p's top-k/top-p/min-p support) mixed with Dirichlet
    noise, and zero on p's third most likely token (which then only recovery can emit)."""
    z = logits.astype(np.float64) / 1.3
    flat = np.exp(z - z.max())
    q = 0.7 * flat / flat.sum() + 0.3 * np.random.default_rng(seed).dirichlet(np.full(len(p), 0.8))
    q[np.argsort(-p)[2]] = 0.0
    return q / q.sum()


@pytest.mark.parametrize("config", list(TARGET_CONFIGS))
@pytest.mark.parametrize("explicit_q", [True, False], ids=["explicit_q", "one_hot_q"])
def test_emitted_tokens_follow_target_distribution(config: str, explicit_q: bool) -> None:
    cfg = TARGET_CONFIGS[config]
    rng = np.random.default_rng(42)
    pos_logits = rng.normal(0.0, 2.5, size=(DIST_K + 1, DIST_VOCAB)).astype(np.float32)
    p = [reference_probs(pos_logits[j], **cfg) for j in range(DIST_K + 1)]
    q = [draft_distribution(pos_logits[j], p[j], seed=7 + j) for j in range(DIST_K)]
    n = DIST_TRIALS

    # Drafts drawn from q in both paths; the one-hot path just isn't told q.
    drafts_np = np.stack([rng.choice(DIST_VOCAB, size=n, p=q[j]) for j in range(DIST_K)], axis=1)
    drafts = drafts_np.tolist()
    logits = torch.from_numpy(np.tile(pos_logits, (n, 1)))
    draft_probs = torch.from_numpy(np.tile(np.stack(q), (n, 1))).float() if explicit_q else None
    meta = SamplingMetadata.from_lists(
        [cfg.get("temperature", 1.0)] * n, top_k=[cfg.get("top_k", 0)] * n,
        top_p=[cfg.get("top_p", 1.0)] * n, min_p=[cfg.get("min_p", 0.0)] * n,
    )
    out = RejectionSampler(Sampler(seed=123))(logits, [DIST_K] * n, drafts, draft_probs, meta)
    check_shape_invariants(out, [DIST_K] * n, drafts)

    tokens = out.accepted_token_ids
    num_acc = np.array(out.num_accepted_drafts)
    label = f"{config}/{'explicit' if explicit_q else 'one-hot'}"
    assert_matches_distribution(np.array([t[0] for t in tokens]), p[0], f"{label} token 0")
    # Given draft 1 was accepted, position 1 is a fresh verification: token 1 ~ p1; likewise
    # the bonus after both drafts ~ p2.
    assert_matches_distribution(np.array([t[1] for t in tokens if len(t) >= 2]), p[1], f"{label} token 1")
    assert_matches_distribution(np.array([t[2] for t in tokens if len(t) >= 3]), p[2], f"{label} bonus token")

    # Acceptance rates match theory: sum_x min(p, q) with q known, sum_x q p with one-hot q.
    for j in range(DIST_K):
        rate = float(np.minimum(p[j], q[j]).sum()) if explicit_q else float((p[j] * q[j]).sum())
        reached = num_acc >= j
        assert_binomial(int((num_acc[reached] > j).sum()), int(reached.sum()), rate, f"{label} accept {j}")


def test_residual_falls_back_to_target_when_p_equals_q() -> None:
    """q == p with a draft p rules out: rejection leaves an all-zero residual, so the recovered
    token must come from p itself (never the draft, never outside the support)."""
    vocab, n = 10, 6000
    pos_logits = np.random.default_rng(3).normal(0.0, 1.0, size=(2, vocab)).astype(np.float32)
    p0 = reference_probs(pos_logits[0], top_k=4)
    p_t = torch.from_numpy(p0).float()
    outside = int(np.nonzero(p0 == 0)[0][0])
    logits = torch.from_numpy(np.tile(pos_logits, (n, 1)))
    draft_probs = torch.stack([p_t] * n)
    meta = SamplingMetadata.from_lists([1.0] * n, top_k=[4] * n)
    out = RejectionSampler(Sampler(seed=5))(logits, [1] * n, [[outside]] * n, draft_probs, meta)
    assert out.num_accepted_drafts == [0] * n
    assert_matches_distribution(np.array([t[0] for t in out.accepted_token_ids]), p0, "fallback")


# ----------------------------------------------------------------- invariants and errors


@pytest.mark.parametrize("explicit_q", [False, True])
def test_random_batches_keep_output_invariants(explicit_q: bool) -> None:
    """Mixed k (0..5), mixed settings, bans: prefix accepted, one more token, never the rejected
    draft, never a banned token."""
    vocab, n = 16, 400
    rng = np.random.default_rng(8)
    ks = [int(k) for k in rng.integers(0, 6, size=n)]
    q = torch.softmax(random_logits(sum(ks), vocab, seed=9), -1)
    drafts_flat = torch.multinomial(q, 1, generator=make_generator(10)).squeeze(1).tolist() if sum(ks) else []
    drafts, i = [], 0
    for k in ks:
        drafts.append(drafts_flat[i:i + k])
        i += k
    banned = [[int(rng.integers(vocab))] for _ in range(n)]
    meta = SamplingMetadata.from_lists(
        [float(t) for t in rng.choice([0.0, 0.5, 1.0, 1.5], size=n)],
        top_p=[float(t) for t in rng.choice([1.0, 0.9], size=n)],
        generators=[make_generator(s) if s % 3 == 0 else None for s in range(n)],
        banned_token_ids=banned,
    )
    logits = random_logits(n + sum(ks), vocab, seed=12)
    out = RejectionSampler(Sampler(seed=0))(logits, ks, drafts, q if explicit_q else None, meta)
    check_shape_invariants(out, ks, drafts)
    for b in range(n):
        assert banned[b][0] not in out.accepted_token_ids[b]
    assert 0 < sum(out.num_accepted_drafts) < sum(ks)


def test_empty_batch() -> None:
    meta = SamplingMetadata.from_lists([])
    out = RejectionSampler(Sampler())(torch.empty(0, 8), [], [], None, meta)
    assert out.accepted_token_ids == [] and out.num_accepted_drafts == []


@pytest.mark.parametrize(
    "ks, drafts, rows, q_rows, meta_rows",
    [
        ([2], [[1, 2]], 2, None, 1),  # logits row count != sum(1 + k)
        ([2], [[1]], 3, None, 1),  # draft list length != k
        ([1], [[1]], 2, None, 2),  # metadata rows != requests
        ([1], [[99]], 2, None, 1),  # draft id outside the vocabulary
        ([1], [[1]], 2, 2, 1),  # draft_probs rows != sum k
    ],
)
def test_invalid_inputs_raise(ks, drafts, rows, q_rows, meta_rows) -> None:
    vocab = 8
    q = torch.full((q_rows, vocab), 1.0 / vocab) if q_rows is not None else None
    with pytest.raises(ValueError):
        RejectionSampler(Sampler())(torch.zeros(rows, vocab), ks, drafts, q,
                                    SamplingMetadata.from_lists([1.0] * meta_rows))
