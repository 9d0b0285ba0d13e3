"""`pdserve serve`'s engine layout and thread budget (server/layout.py) from the host's cores and the
model's size: split prefill and decode only where each engine gets cores of its own, and give a
real-size model every core its engines can use."""
from __future__ import annotations

from pathlib import Path

from conftest import BUNDLED_MODEL

from engine.types import EngineRole, ServeMode
from server import cli
from server.layout import LONG_STEP_WEIGHT_BYTES, Layout, plan_engines, weight_bytes

TINY, BIG = 20 << 20, 1800 << 20  # the bundled model's weight bytes, and a 0.44B fp32 checkpoint's


def test_auto_serves_colocated_where_the_engines_would_share_cores():
    for cores in (1, 2, 4):
        plan = plan_engines(Layout.AUTO, cores, 1, 1, BIG)
        assert plan.mode == ServeMode.COLOCATED and plan.roles == [(EngineRole.COLOCATED, 1)], cores
        assert "too few" in plan.why


def test_auto_splits_prefill_and_decode_where_each_engine_has_cores_of_its_own():
    plan = plan_engines(Layout.AUTO, 5, 1, 1, BIG)
    assert plan.mode == ServeMode.PD and plan.roles == [(EngineRole.PREFILL, 1), (EngineRole.DECODE, 1)]
    assert plan.threads == 2
    assert plan_engines(Layout.AUTO, 8, 2, 2, BIG).mode == ServeMode.COLOCATED  # 4 engines need 9 cores
    assert plan_engines(Layout.AUTO, 9, 2, 2, BIG).mode == ServeMode.PD


def test_a_short_step_model_leaves_a_core_to_the_front_end():
    assert plan_engines(Layout.COLOCATED, 2, 1, 1, TINY).threads == 1
    assert plan_engines(Layout.PD, 2, 1, 1, TINY).threads == 1
    assert plan_engines(Layout.PD, 9, 1, 1, TINY).threads == 4


def test_a_long_step_model_gets_every_core_its_engines_can_use():
    assert plan_engines(Layout.COLOCATED, 2, 1, 1, BIG).threads == 2
    assert plan_engines(Layout.PD, 2, 1, 1, BIG).threads == 2  # a share of 1: both engines take every core
    assert plan_engines(Layout.PD, 8, 1, 1, BIG).threads == 4
    assert plan_engines(Layout.PD, 8, 1, 1, LONG_STEP_WEIGHT_BYTES - 1).threads == 3


def test_forced_layouts_and_threads_are_kept():
    plan = plan_engines(Layout.PD, 2, 1, 1, TINY, num_threads=3)
    assert (plan.mode, plan.threads, plan.why) == (ServeMode.PD, 3, "--mode pd")
    assert plan_engines(Layout.COLOCATED, 64, 1, 1, BIG).mode == ServeMode.COLOCATED


def test_weight_bytes_counts_the_checkpoint_files(tmp_path: Path):
    assert weight_bytes(BUNDLED_MODEL) == sum(f.stat().st_size for f in BUNDLED_MODEL.glob("*.safetensors")) > 0
    (tmp_path / "a.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "b.safetensors").write_bytes(b"x" * 5)
    (tmp_path / "config.json").write_text("{}")
    assert weight_bytes(tmp_path) == 15
    assert weight_bytes(BUNDLED_MODEL) < LONG_STEP_WEIGHT_BYTES  # the bundled model keeps its measured budget


def test_serve_defaults_to_auto():
    assert cli.parse_args(["serve"]).mode == Layout.AUTO
