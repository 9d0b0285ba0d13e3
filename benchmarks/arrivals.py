"""When `pdserve bench` sends each request: the rate plan (one rate, a list, or a GuideLLM-style sweep)
and the arrival schedule of one run (constant, Poisson, or gamma with a burstiness shape).

A schedule is a list of offsets from the run's start, computed up front and seeded, so a run is
reproducible and the sender sleeps until each absolute offset: a slow event loop delays a request
but does not stretch every later gap the way sleeping gap by gap would."""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import numpy as np


class Arrival(StrEnum):
    CONSTANT = "constant"   # gaps of exactly 1/rate
    POISSON = "poisson"     # exponential gaps of mean 1/rate; gamma of shape --burstiness when it is not 1


SWEEP = "sweep"


@dataclass(frozen=True)
class RatePlan:
    """`rates` in order, or a sweep (`rates` empty): probe, then rates between the probes' rates."""

    rates: tuple[float, ...] = ()

    @property
    def is_sweep(self) -> bool:
        return not self.rates


@dataclass(frozen=True)
class RunPlan:
    """One run's traffic: the rate (inf: all at once) and the most requests in flight."""

    rate: float
    max_concurrency: int | None
    initial_test: bool = True
    name: str = ""  # sweep: "synchronous", "throughput" or "constant"/"poisson" (the rates between)


def parse_rate(value: str) -> float:
    v = str(value).strip().lower()
    rate = math.inf if v in ("inf", "infinity") else float(v)
    if not rate > 0:
        raise ValueError(f"a request rate must be > 0 (or inf), got {value!r}")
    return rate


def parse_rate_plan(value: str) -> RatePlan:
    """`--request-rate`: `4`, `inf`, `1,2,4` or `sweep`."""
    text = str(value).strip().lower()
    if text == SWEEP:
        return RatePlan()
    rates = tuple(parse_rate(v) for v in text.split(",") if v.strip())
    if not rates:
        raise ValueError(f"--request-rate: expected a rate, a comma-separated list of rates or 'sweep', got {value!r}")
    return RatePlan(rates)


def sweep_rates(synchronous_rate: float, max_rate: float, points: int) -> list[float]:
    """GuideLLM's sweep: `points` rates evenly spread strictly between the synchronous probe's
    request rate (one request at a time) and the throughput probe's (everything at once)."""
    if points < 1:
        return []
    low, high = sorted((synchronous_rate, max_rate))
    return [float(r) for r in np.linspace(low, high, points + 2)[1:-1]]


def arrival_offsets(num: int, rate: float, arrival: Arrival, burstiness: float, seed: int) -> list[float]:
    """Seconds from the run's start at which each of `num` requests is sent; the first at 0.
    An infinite rate sends everything at once. Poisson gaps are gamma(shape=burstiness,
    mean=1/rate): burstiness 1 is the exponential (Poisson process), below 1 burstier."""
    if num <= 0:
        return []
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    if arrival == Arrival.CONSTANT:
        gaps = np.full(num - 1, 1.0 / rate)
    else:
        rng = np.random.default_rng(seed + 1)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
