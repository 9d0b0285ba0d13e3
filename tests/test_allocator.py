"""Engine processes run under tcmalloc where the system has it (server/allocator.py)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from server.allocator import engine_env, find_tcmalloc
from tests.conftest import BUNDLED_MODEL
from tests.pd_harness import ProcessGroup


def fake_find(name: str) -> str | None:
    return {"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}.get(name)


def test_engine_env_preloads_tcmalloc_ahead_of_what_is_there():
    env = engine_env({"LD_PRELOAD": "/opt/libfoo.so", "X": "1"}, fake_find)
    assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:/opt/libfoo.so" and env["X"] == "1"
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) > 1 << 40  # a big KV cache is no news


@pytest.mark.parametrize("env", [{"PDSERVE_MALLOC": "system"}, {"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}])
def test_engine_env_leaves_alone_a_choice_already_made(env):
    assert engine_env(env, fake_find) == env


def test_engine_env_without_tcmalloc_changes_nothing():
    assert engine_env({"A": "b"}, lambda name: None) == {"A": "b"}


@pytest.mark.skipif(find_tcmalloc() is None, reason="no tcmalloc on this system (libtcmalloc-minimal4)")
def test_a_standalone_engine_restarts_itself_under_tcmalloc(tmp_path):
    """`pdserve colocated` started without LD_PRELOAD maps tcmalloc (same PID: it re-executed itself)."""
    group = ProcessGroup(tmp_path)
    try:
        group.add("colocated", "alloc-test", str(BUNDLED_MODEL))
        maps = Path(f"/proc/{group.procs['alloc-test'].pid}/maps")
        deadline = time.monotonic() + 30
        while "tcmalloc" not in maps.read_text():
            assert group.procs["alloc-test"].poll() is None, "the engine exited"
            assert time.monotonic() < deadline, "no tcmalloc mapped after 30 s"
            time.sleep(0.2)
    finally:
        group.stop()
