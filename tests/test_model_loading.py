"""Checkpoint loading: sharded files, unused keys, missing keys, dtypes (issue: core engine)."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import make_checkpoint, random_prompts
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_sharded_checkpoint_loads(tmp_path, references):
    src = references["llama"].model
    src.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    prompts = random_prompts(4, 3, 40, 384, 51)
    llm = LLM(str(tmp_path), max_model_len=128)
    for p, o in zip(prompts, llm.generate(prompts, GREEDY)):
        references["llama"].assert_matches(p, o.token_ids, 12)


def test_unused_keys_ignored_with_one_log_line_and_missing_key_named(tmp_path, caplog):
    ckpt = make_checkpoint("qwen2", tmp_path / "m")
    weights = load_file(ckpt / "model.safetensors")
    extra = dict(weights)
    extra["model.mtp_layers.0.input_proj.weight"] = torch.zeros(64, 128)
    extra["model.mtp_layers.0.final_layernorm.weight"] = torch.ones(64)
    save_file(extra, ckpt / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="worker.model_loader"):
        LLM(str(ckpt), max_model_len=64).shutdown()
    lines = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(lines) == 1 and "2 checkpoint keys" in lines[0] and "mtp_layers" in lines[0]

    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing key 'model.layers.1.mlp.up_proj.weight'"):
        LLM(str(ckpt), max_model_len=64)


def test_rope_theta_read_from_top_level_and_rope_parameters(tmp_path, references):
    """transformers 5 writes rope_parameters; older checkpoints carry top-level rope_theta."""
    import shutil

    src = references["qwen2"].model
    src.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"]
    cfg["rope_theta"] = theta
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    prompts = random_prompts(3, 50, 120, 384, 52)
    llm = LLM(str(tmp_path), max_model_len=256)
    for p, o in zip(prompts, llm.generate(prompts, GREEDY)):
        references["qwen2"].assert_matches(p, o.token_ids, 12)
    shutil.rmtree(tmp_path)


def test_bfloat16_runs_and_mostly_agrees(checkpoints, references):
    prompts = random_prompts(6, 5, 60, 384, 53)
    llm = LLM(str(checkpoints["qwen3"]), max_model_len=128, dtype="bfloat16")
    assert llm.engine.runner.model.lm_head.weight.dtype == torch.bfloat16
    outs = llm.generate(prompts, GREEDY)
    first_agree = sum(o.token_ids[0] == references["qwen3"].generate(p, 12)[0][0] for p, o in zip(prompts, outs))
    assert all(len(o.token_ids) == 12 for o in outs) and first_agree >= 4


@pytest.mark.parametrize("sliding_window", [None, 40])
def test_mistral_with_and_without_sliding_window(tmp_path, sliding_window):
    import transformers
    from conftest import Reference

    cfg = transformers.MistralConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                     initializer_range=0.08, sliding_window=sliding_window, eos_token_id=1)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    ref = Reference(tmp_path)
    prompts = random_prompts(6, 20, 120, 384, 54)  # longer than the window
    llm = LLM(str(tmp_path), max_model_len=256, block_size=4, max_num_batched_tokens=32)
    for i, (p, o) in enumerate(zip(prompts, llm.generate(prompts, GREEDY))):
        ref.assert_matches(p, o.token_ids, 12, f"mistral/window={sliding_window}/{i}")


def test_stacked_projections_take_each_checkpoint_tensor(checkpoints):
    """q/k/v and gate/up are loaded into row slices of one stacked GEMM each (and packed on CPU):
    every layer computes exactly what the separate checkpoint tensors would."""
    path = checkpoints["qwen2"]  # qkv bias too
    weights = load_file(str(path / "model.safetensors"))
    llm = LLM(str(path), max_model_len=64)
    layer = llm.engine.runner.model.model.layers[1]
    pre = "model.layers.1."
    x = torch.randn(5, weights[pre + "self_attn.q_proj.weight"].shape[1])
    want_qkv = torch.cat([x @ weights[pre + f"self_attn.{n}_proj.weight"].T + weights[pre + f"self_attn.{n}_proj.bias"]
                          for n in "qkv"], dim=-1)
    want_gate_up = torch.cat([x @ weights[pre + f"mlp.{n}_proj.weight"].T for n in ("gate", "up")], dim=-1)
    with torch.inference_mode():  # whichever weight (packed for oneDNN, or plain) tuning kept for 5 rows
        torch.testing.assert_close(layer.self_attn.qkv_proj(x), want_qkv, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.mlp.gate_up_proj(x), want_gate_up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 17])
def test_packed_linear_matches_f_linear(rows):
    from worker.models.linear import Linear

    torch.manual_seed(rows)
    lin = Linear(48, 80, bias=True)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        want = torch.nn.functional.linear(x, lin.weight, lin.bias)
        lin.pack(keep_weight=False)
        assert lin.weight.numel() == 0  # the packed copy is the only one left
        torch.testing.assert_close(lin(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_gate_up_computes_silu_and_mul_as_post_ops(bias):
    """A packed GateUpLinear multiplies the rows that run packed by its two halves, SiLU and the
    product fused into oneDNN's GEMMs; fewer rows go the plain way. Both equal the expanded form,
    and its forward still returns the stacked projection."""
    from worker.models.linear import GateUpLinear

    torch.manual_seed(int(bias))
    lin = GateUpLinear(48, 40, bias=bias)
    lin.pack(keep_weight=True)
    lin.packed_from = 4
    binary = torch.ops.mkldnn._linear_pointwise.binary
    calls = []
    with torch.inference_mode():
        for rows in (1, 3, 4, 17):
            x = torch.randn(rows, 48)
            stacked = torch.nn.functional.linear(x, lin.weight, lin.bias)
            gate, up = stacked.chunk(2, dim=-1)
            torch.ops.mkldnn._linear_pointwise.binary = lambda *a, n=rows, **k: calls.append(n) or binary(*a, **k)
            try:
                got = lin.silu_and_mul(x)
            finally:
                torch.ops.mkldnn._linear_pointwise.binary = binary
            torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lin(x), stacked, atol=1e-5, rtol=1e-5)
    assert calls == [4, 17]


def test_a_tuned_linear_runs_f_linear_below_its_threshold_and_oneDNN_from_it():
    from worker.models.linear import Linear

    torch.manual_seed(0)
    lin = Linear(48, 80, bias=True)
    lin.pack(keep_weight=True)
    lin.packed_from = 4
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    with torch.inference_mode():
        for rows in (1, 3, 4, 17):
            x = torch.randn(rows, 48)
            want = torch.nn.functional.linear(x, lin.weight, lin.bias)
            before = len(calls)
            torch.ops.mkldnn._linear_pointwise = lambda *a, **k: calls.append(1) or real(*a, **k)
            try:
                got = lin(x)
            finally:
                torch.ops.mkldnn._linear_pointwise = real
            assert (len(calls) > before) == (rows >= 4), rows
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_packed_threshold_is_the_cheapest_over_all_row_counts():
    from worker.models.linear import TUNE_ROWS, _cheapest_first

    n = len(TUNE_ROWS)
    assert _cheapest_first([1.0] * n, [2.0] * n) == 0             # packed always faster: always packed
    assert _cheapest_first([2.0] * n, [1.0] * n) == n             # never
    slow_small = [3.0, 3.0, 3.0, 1.0, 1.0, 1.0, 1.0]               # oneDNN wins from 8 rows
    assert _cheapest_first(slow_small, [1.5] * n) == 3
    # A near-tie that noise flipped at 32 rows does not move the threshold to 64.
    noisy = [3.0, 3.0, 3.0, 1.0, 1.0, 1.51, 1.0]
    assert _cheapest_first(noisy, [1.5] * n) == 3


def test_tuning_disturbed_on_most_of_its_sweeps_still_finds_the_faster_weight(tmp_path):
    """A process sharing the core while an engine tunes delays most sweeps of a row count: the
    choice follows the undisturbed sweeps (packed here, 1.0 against F.linear's 1.5)."""
    from worker.models import linear as L

    lin = L.Linear(32, 32, bias=False)
    lin.pack(keep_weight=True)
    calls, packed_sweeps = [0], [0]

    def timer() -> float:  # read before and after each timed call
        calls[0] += 1
        if calls[0] % 2:
            return 0.0
        if lin.packed_from == 0:  # the packed weight was timed
            packed_sweeps[0] += 1
            return 1.0 + (2.0 if packed_sweeps[0] % 4 else 0.0)  # 3 of every 4 sweeps disturbed
        return 1.5

    L.tune_linears([lin], timer=timer, record=tmp_path / "tuning.json")
    assert lin.packed_from == L.TUNE_ROWS[0]


def test_a_later_engine_runs_what_the_first_one_chose(tmp_path):
    """The tuning record: a shape tuned once on a machine is not timed again (its sweeps could come
    out the other way), and a record of another machine does not count."""
    from worker.models import linear as L

    record = tmp_path / "tuning.json"
    calls, current = [0], [None]

    def timer_for(packed: float, plain: float):
        def timer() -> float:  # read before (0) and after (the call's cost) each timed call
            calls[0] += 1
            return 0.0 if calls[0] % 2 else packed if current[0].packed_from == 0 else plain
        return timer

    first, later = L.Linear(32, 32, bias=False), L.Linear(32, 32, bias=False)
    for lin in (first, later):
        lin.pack(keep_weight=True)
    current[0] = first
    L.tune_linears([first], timer=timer_for(packed=1.0, plain=2.0), record=record)
    assert first.packed_from == L.TUNE_ROWS[0]
    timed = calls[0]
    current[0] = later
    L.tune_linears([later], timer=timer_for(packed=2.0, plain=1.0), record=record)
    assert calls[0] == timed and later.packed_from == L.TUNE_ROWS[0]  # not timed: the record's choice

    other = json.loads(record.read_text())
    record.write_text(json.dumps({"another machine": next(iter(other.values()))}))
    L.tune_linears([later], timer=timer_for(packed=2.0, plain=1.0), record=record)
    assert calls[0] > timed and later.packed_from > L.TUNE_ROWS[-1]  # timed here: never packed


def test_pack_linears_frees_the_weight_it_never_runs(tmp_path, monkeypatch):
    """Each linear keeps just the copies of its weight some row count runs: the plain one only where
    F.linear serves a row count or it is shared, the packed one only where it serves one, our
    kernel's panels only where the kernel serves one; every way computes the same linear."""
    from worker.models import linear as L

    kernel = L.linear_kernels_available()
    n = len(L.TUNE_ROWS)
    choices = {  # out_features: (kernel_rows, packed_first)
        8: (0, 0),   # packed everywhere
        16: (0, n),  # F.linear everywhere
        24: (0, 2),  # F.linear to 2 rows, packed from 3
        32: (2, 2),  # our kernel to 2 rows, packed from 3
        40: (n, n),  # our kernel to 64 rows, F.linear past them
        48: (2, 2),  # as 32, but shared
    }
    record = tmp_path / "tuning.json"
    record.write_text(json.dumps({L._machine(): {f"32x{out} float32": {"kernel_rows": k, "packed_first": p}
                                                 for out, (k, p) in choices.items()}}))
    monkeypatch.setenv("PDSERVE_LINEAR_TUNING", str(record))
    torch.manual_seed(1)
    lins = {out: L.Linear(32, out, bias=False) for out in choices}
    xs = [torch.randn(rows, 32) for rows in (1, 3, 9, 70)]
    with torch.inference_mode():
        want = {out: [torch.nn.functional.linear(x, lin.weight) for x in xs] for out, lin in lins.items()}
        L.pack_linears(torch.nn.Sequential(*lins.values()), "cpu", shared={id(lins[48].weight)})
        held = {out: (lin.weight.numel() > 0, lin.packed is not None, lin.panels is not None)
                for out, lin in lins.items()}
        assert held[8] == (False, True, False) and held[16] == (True, False, False)
        assert held[24] == (True, True, False)
        if kernel:
            assert held[32] == (False, True, True) and held[40] == (True, False, True)
            assert held[48] == (True, True, True)
        for out, lin in lins.items():
            for x, w in zip(xs, want[out]):
                torch.testing.assert_close(lin(x), w, atol=1e-5, rtol=1e-5)


def test_our_kernel_runs_the_row_counts_where_it_beats_both_libraries_from_the_first_on():
    from worker.models.linear import TUNE_ROWS, _choose

    n = len(TUNE_ROWS)
    # Our kernel clearly faster for 1..2 rows, a few percent faster at 4 (where a margin once gave the
    # library the row count), slower at 8 and beyond; oneDNN from 16 rows.
    kernel = [1.0, 1.0, 1.4, 1.6, 5.0, 5.0, 5.0]
    plain = [2.0, 2.0, 1.5, 1.5, 2.0, 2.0, 2.0]
    packed = [3.0, 3.0, 3.0, 3.0, 1.0, 1.0, 1.0]
    assert _choose({"kernel": kernel, "plain": plain, "packed": packed}) == {"kernel_rows": 3, "packed_first": 4}
    # Never faster at the first row count: never used, even where it wins later.
    assert _choose({"kernel": [2.5] + [0.1] * (n - 1), "plain": [2.0] * n, "packed": [3.0] * n}) == {
        "kernel_rows": 0, "packed_first": n}
    # Fastest at every row count: the last one still picks the library for bigger inputs.
    assert _choose({"kernel": [0.5] * n, "plain": [2.0] * n, "packed": [1.0] * n}) == {
        "kernel_rows": n, "packed_first": n - 1}
    assert _choose({"kernel": [0.5] * n, "plain": [1.0] * n, "packed": [2.0] * n}) == {
        "kernel_rows": n, "packed_first": n}


def test_tuning_times_our_kernel_and_records_its_rows(tmp_path):
    from worker.models import linear as L

    if not L.linear_kernels_available():
        pytest.skip("no C++ compiler for our linear kernels")
    lin = L.Linear(32, 32, bias=False)
    lin.pack(keep_weight=True)
    calls = [0]

    def timer() -> float:  # our kernel fastest at every row count
        calls[0] += 1
        if calls[0] % 2:
            return 0.0
        return 1.0 if lin.kernel_to else 3.0 if lin.packed_from == 0 else 2.0

    L.tune_linears([lin], timer=timer, record=tmp_path / "tuning.json")
    assert lin.kernel_to == L.TUNE_ROWS[-1] and lin.packed_from > L.TUNE_ROWS[-1]
    assert json.loads((tmp_path / "tuning.json").read_text()) == {
        L._machine(): {"32x32 float32": {"kernel_rows": len(L.TUNE_ROWS), "packed_first": len(L.TUNE_ROWS)}}}


@pytest.mark.parametrize("kernel_rows,packed_first,kernel_to,packed_from", [
    (2, 2, 2, 3),    # our kernel swept fastest at 1-2 rows, oneDNN from 4: 3 rows run oneDNN, not F.linear
    (0, 3, 0, 5),    # F.linear at 1-4, oneDNN from 8: 5-7 rows run oneDNN
    (0, 0, 0, 1),    # oneDNN everywhere
    (4, 7, 8, None),   # never packed: F.linear past our kernel's 8 rows
    (7, 6, 64, 65),    # our kernel at every swept row count; oneDNN, chosen at 64, past them
])
def test_row_counts_between_two_swept_ones_run_the_way_of_the_larger(
        tmp_path, kernel_rows, packed_first, kernel_to, packed_from):
    """Only TUNE_ROWS are swept; a 3-row step once ran F.linear (MKL: a GEMV per row) on a weight
    whose 2- and 4-row sweeps chose our kernel and oneDNN, several times slower than either."""
    from worker.models import linear as L

    if kernel_rows and not L.linear_kernels_available():
        pytest.skip("no C++ compiler for our linear kernels")
    record = tmp_path / "tuning.json"
    record.write_text(json.dumps({L._machine(): {"32x32 float32": {
        "kernel_rows": kernel_rows, "packed_first": packed_first}}}))
    lin = L.Linear(32, 32, bias=False)
    lin.pack(keep_weight=True)
    L.tune_linears([lin], timer=lambda: pytest.fail("a recorded shape is not timed"), record=record)
    assert (lin.kernel_to, lin.packed_from) == (kernel_to, packed_from or L.NEVER_PACKED)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17])
@pytest.mark.parametrize("in_features,out_features", [(16, 2), (33, 7), (1031, 65), (3072, 64)])
def test_our_fp32_kernel_computes_the_linear(rows, in_features, out_features):
    """Every path of the kernel: whole passes of rows over a panel and each shorter last pass, a
    last panel of fewer features, odd input widths; fp32 sums in another order than MKL's, so
    equal up to rounding."""
    from worker.models import linear as L

    if not L.linear_kernels_available():
        pytest.skip("no C++ compiler for our linear kernels")
    torch.manual_seed(rows * 1000 + in_features)
    lin = L.Linear(in_features, out_features, bias=True)
    lin.pack(keep_weight=True)
    lin.use_kernel(17)
    lin.packed_from = 18
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        want = x.double() @ lin.weight.double().T + lin.bias.double()
        got = lin(x)
    torch.testing.assert_close(got.double(), want, atol=1e-4 * in_features ** 0.5, rtol=1e-5)


def test_a_recorded_choice_of_our_kernel_runs_in_a_fresh_process(tmp_path):
    """An engine that takes the kernel from the record (no timing, so nothing of its own loaded the
    kernel) runs it: a fresh process, as the second engine of a machine is."""
    import subprocess
    import sys

    from conftest import REPO

    from worker.models import linear as L

    if not L.linear_kernels_available():
        pytest.skip("no C++ compiler for our linear kernels")
    record = tmp_path / "tuning.json"
    child = (
        "import json, sys, torch\ntorch.set_num_threads(1)\n"
        "from worker.models import linear as L\n"
        "lin = L.Linear(64, 32, bias=False); lin.pack(keep_weight=True)\n"
        "L.tune_linears([lin], record=__import__('pathlib').Path(sys.argv[1]))\n"
        "x = torch.randn(1, 64)\n"
        "torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight), atol=1e-5, rtol=1e-5)\n"
        "print(lin.kernel_to)\n")
    key = "64x32 float32"
    record.write_text(json.dumps({L._machine(): {key: {"kernel_rows": 1, "packed_first": 1}}}))
    run = subprocess.run([sys.executable, "-c", child, str(record)], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "1"
