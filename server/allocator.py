"""tcmalloc for engine processes, where the system has it (as vLLM's CPU worker asks for).

glibc's malloc hands every large tensor (a prefill's activations: megabytes each) back to the OS on
free and takes it again, zero-filled page by page, on the next step: a long prefill of the bundled
model spends a visible share of its time in page faults inside SiLU and the GEMMs (a torch profile).
tcmalloc keeps freed memory for reuse and makes prefill faster (benchmarks/bench_prefill.py,
benchmarks/results/prefill.txt). It has to be
preloaded before the process starts, so `pdserve serve` sets it in its engines' environment and a
standalone engine (`pdserve prefill|decode|colocated`, one per container) re-executes itself once
with it. PDSERVE_MALLOC=system keeps glibc's.
"""
from __future__ import annotations

import ctypes.util
import logging
import os
import sys
from collections.abc import Callable, Mapping

from engine import settings

logger = logging.getLogger(__name__)

LIBRARIES = ("tcmalloc_minimal", "tcmalloc")  # Debian/Ubuntu: libtcmalloc-minimal4 / google-perftools


def find_tcmalloc(find: Callable[[str], str | None] = ctypes.util.find_library) -> str | None:
    """The soname of an installed tcmalloc (the dynamic loader finds it by name), else None."""
    return next((lib for name in LIBRARIES if (lib := find(name))), None)


def engine_env(env: Mapping[str, str], find: Callable[[str], str | None] = ctypes.util.find_library) -> dict[str, str]:
    """`env` with tcmalloc in LD_PRELOAD (ahead of what is there), unless PDSERVE_MALLOC=system,
    it is there already, or the system has none."""
    out = dict(env)
    lib = None if settings.MALLOC.get(env) == "system" else find_tcmalloc(find)
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if lib is None or any("tcmalloc" in p for p in preload):
        return out
    out["LD_PRELOAD"] = ":".join([lib, *preload])
    # tcmalloc reports every allocation over 1 GiB on stderr; a big KV cache is one, on purpose.
    out.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 62))
    return out


def reexec_with_tcmalloc() -> None:
    """Replace this process with itself under tcmalloc when it is not loaded yet (and can be)."""
    env = engine_env(os.environ)
    if env.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD"):
        return
    logger.info("restarting under tcmalloc (%s); PDSERVE_MALLOC=system keeps glibc's malloc", env["LD_PRELOAD"])
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
