"""worker/cpp_build.py: a build killed mid-way must not hang every later engine start.

torch's extension loader serialises builds with a `lock` file in the build folder and waits for it
to vanish, forever; a build killed mid-way (an engine stopped while it compiled) leaves the file,
and every engine started after that never became ready. The engine's loader must notice the
leftover and load anyway."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from torch.utils import cpp_extension

from worker import cpp_build, cpu_attention

REPO = Path(__file__).resolve().parents[1]


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load() -> None:
    assert cpu_attention.available()  # built (or loaded) once, so the load below compiles nothing
    name = cpp_build.extension_name("paged_attention.cpp", cpu_attention.CFLAGS)
    lock = Path(cpp_extension._get_build_directory(name, False)) / "lock"
    lock.touch()  # what a build killed between taking and releasing torch's baton leaves
    code = "from worker import cpu_attention; assert cpu_attention.available()"
    # Before the fix this waited on the lock forever; bounded here, so a regression fails, not hangs.
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "left by a killed build" in done.stderr
    assert not lock.exists()
