"""Which engines `pdserve serve` starts on this host, and how many torch threads each gets.

Layout (`--mode`):
- On a host whose cores the engines would have to share, one colocated engine serves faster than
  a prefill and a decode engine: its chunked-prefill step reads each weight once for the prompt
  chunk and for every decoding row beside it, where P and D each read all the weights and take
  turns on the same cores and memory, and the KV cache crosses between them besides.
  benchmarks/results/peers.md measures both on a 2-core host.
- So `auto` (the default) splits prefill and decode only where every engine gets
  PD_MIN_CORES_PER_ENGINE cores of its own beside one for the front end; `pd` and `colocated` force
  a layout.

Threads (`--num-threads`, default):
- A model whose step is short (the bundled model: milliseconds) leaves one core to the front end
  (HTTP, detokenizing, the engines' ZMQ traffic), as vLLM leaves one to its API server: an engine with
  every core stalls at its OpenMP barriers whenever the front end takes one.
- A model whose weights alone take LONG_STEP_WEIGHT_BYTES or more runs steps of tens of milliseconds
  and up, and the front end's share of a step is small: each engine gets its share of the cores, or
  every core where its share would be one (engines that share cores take turns; an idle engine's
  threads sleep, server/openmp.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from engine.types import EngineRole, ServeMode

PD_MIN_CORES_PER_ENGINE = 2
LONG_STEP_WEIGHT_BYTES = 256 << 20


class Layout(enum.StrEnum):
    AUTO = "auto"
    PD = "pd"
    COLOCATED = "colocated"


@dataclass(frozen=True)
class EnginePlan:
    mode: ServeMode
    roles: list[tuple[EngineRole, int]]  # (role, how many engines)
    threads: int  # torch threads per engine
    why: str  # for the banner: how the layout was chosen


def weight_bytes(model_dir: str | Path) -> int:
    """The checkpoint's weight bytes as stored (every *.safetensors file of the folder)."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def plan_engines(layout: Layout, cores: int, num_prefill: int, num_decode: int, model_bytes: int,
                 num_threads: int | None = None) -> EnginePlan:
    """The engines of one `pdserve serve` on `cores` cores for a model of `model_bytes` weight bytes."""
    pd_engines = num_prefill + num_decode
    if layout == Layout.AUTO:
        split = cores >= PD_MIN_CORES_PER_ENGINE * pd_engines + 1
        why = (f"auto: {cores} cores give each of {pd_engines} engines {PD_MIN_CORES_PER_ENGINE} of its own"
               if split else f"auto: {cores} cores are too few for {pd_engines} engines with "
               f"{PD_MIN_CORES_PER_ENGINE} cores each (--mode pd splits anyway)")
        layout = Layout.PD if split else Layout.COLOCATED
    else:
        why = f"--mode {layout}"
    if layout == Layout.COLOCATED:
        mode, roles = ServeMode.COLOCATED, [(EngineRole.COLOCATED, 1)]
    else:
        mode, roles = ServeMode.PD, [(EngineRole.PREFILL, num_prefill), (EngineRole.DECODE, num_decode)]
    engines = sum(n for _, n in roles)
    if num_threads:
        threads = num_threads
    elif model_bytes >= LONG_STEP_WEIGHT_BYTES:
        share = cores // engines
        threads = share if share > 1 else cores
    else:
        threads = max(1, (cores - 1) // engines)
    return EnginePlan(mode, roles, threads, why)
