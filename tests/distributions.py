"""Exact reference distributions and a chi-square check, shared by the sampler and rejection-sampler tests."""
from __future__ import annotations

import numpy as np
from scipy import stats

CHI2_MIN_P_VALUE = 1e-3


def reference_probs(
    logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """softmax(logits / T), then top-k, top-p, min-p, each followed by renormalisation (float64)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    if top_k > 0:
        keep = np.zeros_like(p, dtype=bool)
        keep[order[:top_k]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if top_p < 1.0:
        cum = np.cumsum(p[order])
        assert np.abs(cum - top_p).min() > 1e-4, "pick another top_p: nucleus boundary too close"
        n_keep = int(np.argmax(cum >= top_p)) + 1
        keep = np.zeros_like(p, dtype=bool)
        keep[order[:n_keep]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if min_p > 0.0:
        threshold = min_p * p.max()
        assert np.abs(p[p > 0] - threshold).min() > 1e-6, "pick another min_p: boundary too close"
        p = np.where(p >= threshold, p, 0.0)
        p /= p.sum()
    return p


def assert_matches_distribution(samples: np.ndarray, probs: np.ndarray, label: str = "") -> None:
    """Never outside the support, and a chi-square fit over it (bins expecting < 5 pooled)."""
    n = len(samples)
    assert n > 500, f"{label}: too few samples ({n}) for a meaningful test"
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    outside = probs == 0
    assert counts[outside].sum() == 0, f"{label}: tokens outside the support: {np.nonzero(counts * outside)[0]}"
    expected = probs * n
    big = expected >= 5
    obs, exp = list(counts[big]), list(expected[big])
    small = (~big) & (~outside)
    if small.any():
        obs.append(counts[small].sum())
        exp.append(expected[small].sum())
    if len(obs) < 2:
        return
    _, p_value = stats.chisquare(obs, exp)
    assert p_value > CHI2_MIN_P_VALUE, f"{label}: chi-square p={p_value:.2e}; obs={obs}; exp={np.round(exp, 1)}"
