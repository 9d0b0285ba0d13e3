"""How an engine's OpenMP threads wait between parallel regions (libgomp, torch's OpenMP on Linux).

A decode step of a real-size model is hundreds of parallel regions back to back, a few per layer,
microseconds apart; between steps the engine's main thread does Python work for milliseconds.
- Threads that sleep as soon as a region ends (OMP_WAIT_POLICY=PASSIVE) pay a futex wake-up at
  the start of every next region, and a many-region step pays it hundreds of times.
- Threads that spin without bound (ACTIVE, or libgomp's default of 300000 spins) keep a core
  busy between steps too, while the front end, the load or the other engine on the same few
  cores needs it.
A bounded spin covers the gaps inside a step and sleeps across the gaps between steps:
benchmarks/bench_openmp.py measures the three.
"""
from __future__ import annotations

from collections.abc import Mapping

# Spins (one `pause` and a load each) before a waiting thread sleeps: on the order of a millisecond.
SPIN_COUNT = 30000
CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def openmp_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with pdserve's bounded spin, unless the user chose a wait policy or spin count."""
    out = dict(env)
    if not any(env.get(name) for name in CHOICES):
        out["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return out
