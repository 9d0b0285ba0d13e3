"""Builds and loads the C++ extensions under `worker/csrc/` at engine start.

torch's extension builder compiles a source with the host's C++ compiler (the one Inductor needs
too) into `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`), so a restart loads the
cached library instead of compiling again, and two engines starting at once share one build (it
holds a lock). Where a build fails the caller says so once and uses its torch reference.
"""
from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"


def build(source: str, cflags: list[str], what: str) -> bool:
    """Build (or load the cached build of) `csrc/<source>`, which registers its ops with torch;
    False where that fails. `what` names it in the log."""
    from torch.utils import cpp_extension

    path = CSRC / source
    start = time.monotonic()
    # One build per source text, flags and checkout: two checkouts sharing the extensions folder
    # under one name would rebuild each other's library at every start.
    tag = hashlib.sha256(path.read_bytes() + str(path).encode() + str(cflags).encode()).hexdigest()[:12]
    try:
        cpp_extension.load(name=f"pdserve_{path.stem}_{tag}", sources=[str(path)], is_python_module=False,
                           extra_cflags=cflags, extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, no ninja, a broken toolchain: stay correct, just slower
        logger.warning("C++ %s unavailable (%s); using the torch reference", what, e)
        return False
    logger.info("C++ %s ready (%.1f s)", what, time.monotonic() - start)
    return True
