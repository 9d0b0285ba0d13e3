"""Prometheus histograms scraped before and after a run: the run's own buckets (the delta) and
quantiles estimated from them the way Prometheus's `histogram_quantile` does (linear within the
bucket the rank falls in), so a percentile from /metrics can sit beside the client's own."""
from __future__ import annotations

import math


def _bound(le: str) -> float:
    return math.inf if le in ("+Inf", "Inf", "inf") else float(le)


def bucket_deltas(before: dict[str, float] | None, after: dict[str, float] | None,
                  name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of each bucket of `name` over the run, by bound; empty when
    the server does not export it."""
    if not after:
        return []
    before = before or {}
    prefix = f"{name}_bucket{{le="
    out = [(_bound(k[len(prefix):-1]), v - before.get(k, 0.0)) for k, v in after.items() if k.startswith(prefix)]
    return sorted(out)


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus's estimate of quantile `q` (0..1) from cumulative buckets; None without samples.
    A rank in the +Inf bucket gives the largest finite bound, as Prometheus does."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank and cumulative > below:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (cumulative - below)
        lower, below = upper, cumulative
    return lower


def bucket_of(buckets: list[tuple[float, float]], value: float) -> tuple[float, float]:
    """(lower, upper] bounds of the bucket that holds `value`."""
    lower = 0.0
    for upper, _ in buckets:
        if value <= upper:
            return lower, upper
        lower = upper
    return lower, math.inf
