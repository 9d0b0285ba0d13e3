"""Builds and loads the C++ extensions under `worker/csrc/` at engine start.

torch's extension builder compiles a source with the host's C++ compiler (the one Inductor needs
too) into `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`), so a restart loads the
cached library instead of compiling again, and two engines starting at once share one build.
torch serialises builds with a `lock` file that a killed build leaves behind, and every later load
of that extension then waits on it forever (an engine that never becomes ready): builds here are
serialised by an flock instead, which the kernel releases when its holder dies, and under it a
leftover `lock` file is known to be stale and removed. Where a build fails the caller says so once
and uses its torch reference.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"


def extension_name(source: str, cflags: list[str]) -> str:
    """The extension's name: one build per source text (with the headers it may include), flags and
    checkout (two checkouts sharing the extensions folder under one name would rebuild each other's
    library at every start)."""
    path = CSRC / source
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
    tag = hashlib.sha256(path.read_bytes() + headers + str(path).encode() + str(cflags).encode()).hexdigest()[:12]
    return f"pdserve_{path.stem}_{tag}"


def build(source: str, cflags: list[str], what: str) -> bool:
    """Build (or load the cached build of) `csrc/<source>`, which registers its ops with torch;
    False where that fails. `what` names it in the log."""
    from torch.utils import cpp_extension

    start = time.monotonic()
    name = extension_name(source, cflags)
    try:
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        with open(build_dir / "pdserve.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # another engine building it: wait for that build
            leftover = build_dir / "lock"
            if leftover.exists():
                logger.warning("removing %s, left by a killed build of the C++ %s", leftover, what)
                leftover.unlink()
            cpp_extension.load(name=name, sources=[str(CSRC / source)], is_python_module=False,
                               extra_cflags=cflags, extra_ldflags=["-fopenmp"], build_directory=str(build_dir))
    except Exception as e:  # no compiler, no ninja, a broken toolchain: stay correct, just slower
        logger.warning("C++ %s unavailable (%s); using the torch reference", what, e)
        return False
    logger.info("C++ %s ready (%.1f s)", what, time.monotonic() - start)
    return True
