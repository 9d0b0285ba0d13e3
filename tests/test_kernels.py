"""Tests for worker/kernels.py: torch reference vs Triton vs a naive loop oracle.

The Triton kernels run on CPU through Triton's interpreter.  Triton picks
"interpreted or compiled" when a ``@triton.jit`` function is *decorated*, i.e.
when ``worker.kernels`` is first imported, and another test module may already
have imported it in this pytest process.  So the Triton side runs in one
subprocess (this file executed as a script) with ``TRITON_INTERPRET=1`` and
``PDSERVE_USE_TRITON=1``; it regenerates the same seeded cases, runs the public
dispatchers, proves the Triton path was taken, and saves the outputs, which
the tests here compare against the oracle and the torch reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # running as a script from the subprocess
    sys.path.insert(0, str(REPO_ROOT))

from worker import fused_ops, kernels  # noqa: E402

I32 = torch.int32

# --------------------------------------------------------------------------- #
# Seeded case generation (shared by the pytest process and the subprocess)
# --------------------------------------------------------------------------- #
NUM_SLOTS = 16
MAX_LEN = 64


def _ri(gen: torch.Generator, lo: int, hi: int) -> int:
    """Random int in [lo, hi] (inclusive)."""
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def _step_batch(gen: torch.Generator, B: int, K: int, pad: int, prefill_frac: float,
                overflow: bool = False) -> dict[str, torch.Tensor]:
    """A batch of B rows in distinct random slots, mixed prefill/decode rows."""
    idx = torch.randperm(NUM_SLOTS, generator=gen)[:B].to(I32)
    is_prefilling = torch.rand(B, generator=gen) < prefill_frac
    qlens, num_computed, num_draft = [], [], []
    for b in range(B):
        if is_prefilling[b]:
            qlen = _ri(gen, 1, 20)
            nd = _ri(gen, 0, K)  # garbage for prefill rows: the kernels must ignore it
        else:
            nd = _ri(gen, 0, K)
            qlen = 1 + nd
        hi = MAX_LEN - qlen
        nc = _ri(gen, max(0, hi - 3), MAX_LEN + 5) if overflow else _ri(gen, 0, hi)
        qlens.append(qlen)
        num_computed.append(nc)
        num_draft.append(nd)
    qsl = torch.zeros(B + 1, dtype=I32)
    qsl[1:] = torch.cumsum(torch.tensor(qlens, dtype=I32), 0)
    T = int(qsl[-1]) + pad
    return {
        "input_ids": -torch.randint(1, 1000, (T,), generator=gen).to(I32),  # sentinels < 0
        "all_token_ids": torch.randint(0, 50_000, (NUM_SLOTS, MAX_LEN), generator=gen).to(I32),
        "last_sampled_tokens": torch.randint(0, 50_000, (NUM_SLOTS,), generator=gen).to(I32),
        "draft_tokens": torch.randint(0, 50_000, (NUM_SLOTS, K), generator=gen).to(I32),
        "num_draft_tokens": torch.tensor(num_draft, dtype=I32),
        "idx_mapping": idx,
        "query_start_loc": qsl,
        "num_computed_tokens": torch.tensor(num_computed, dtype=I32),
        "is_prefilling": is_prefilling,
    }


def _post_step_batch(gen: torch.Generator, B: int, M: int, overflow: bool = False) -> dict[str, torch.Tensor]:
    idx = torch.randperm(NUM_SLOTS, generator=gen)[:B].to(I32)
    num_sampled = torch.randint(0, M + 1, (B,), generator=gen).to(I32)
    if B >= 2:  # always at least one mid-prefill row and one sampling row
        num_sampled[0] = 0
        num_sampled[1] = M
    total_len = torch.randint(0, MAX_LEN + 1, (NUM_SLOTS,), generator=gen).to(I32)
    for b in range(B):
        s, n = int(idx[b]), int(num_sampled[b])
        lo = MAX_LEN - n - 2 if overflow else 0
        hi = MAX_LEN + 1 if overflow else MAX_LEN - n
        total_len[s] = _ri(gen, max(lo, 0), hi)
    if B >= 2 and not overflow:
        total_len[int(idx[1])] = MAX_LEN - M  # exactly fills the row
    return {
        "all_token_ids": torch.randint(0, 50_000, (NUM_SLOTS, MAX_LEN), generator=gen).to(I32),
        "total_len": total_len,
        "last_sampled_tokens": torch.randint(0, 50_000, (NUM_SLOTS,), generator=gen).to(I32),
        "sampled_token_ids": torch.randint(0, 50_000, (B, M), generator=gen).to(I32),
        "num_sampled": num_sampled,
        "idx_mapping": idx,
    }


GATHER_ARGS = ["input_ids", "all_token_ids", "idx_mapping", "query_start_loc",
               "num_computed_tokens", "is_prefilling"]
COMBINE_ARGS = ["input_ids", "last_sampled_tokens", "draft_tokens", "num_draft_tokens",
                "idx_mapping", "query_start_loc", "is_prefilling"]
POST_ARGS = ["all_token_ids", "total_len", "last_sampled_tokens", "sampled_token_ids",
             "num_sampled", "idx_mapping"]
# Which inputs each kernel may modify.
OUTPUTS = {
    "gather": ["input_ids"],
    "combine": ["input_ids"],
    "post": ["all_token_ids", "total_len", "last_sampled_tokens"],
}
ARGS = {"gather": GATHER_ARGS, "combine": COMBINE_ARGS, "post": POST_ARGS}


def _build_cases() -> dict[str, tuple[str, int, dict[str, Any]]]:
    """case id -> (kernel kind, seed, generator params)."""
    cases: dict[str, tuple[str, int, dict[str, Any]]] = {}
    seed = 0
    for kind in ("gather", "combine"):
        for B in (1, 3, 8, 16):
            for K in (1, 3):
                seed += 1
                pad = 0 if seed % 2 else 5  # some batches have a padded tail
                frac = {"gather": 0.6, "combine": 0.4}[kind]
                cases[f"{kind}-B{B}-K{K}-pad{pad}"] = (kind, seed, dict(B=B, K=K, pad=pad, prefill_frac=frac))
        seed += 1
        cases[f"{kind}-all-prefill"] = (kind, seed, dict(B=6, K=3, pad=2, prefill_frac=1.0))
        seed += 1
        cases[f"{kind}-all-decode"] = (kind, seed, dict(B=6, K=3, pad=2, prefill_frac=0.0))
    for B in (1, 3, 8, 16):
        for M in (1, 4):
            seed += 1
            cases[f"post-B{B}-M{M}"] = ("post", seed, dict(B=B, M=M))
    return cases


# Cases that violate a caller precondition: only torch-vs-Triton agreement and
# "nothing outside the row/slot was written" are checked.
def _build_overflow_cases() -> dict[str, tuple[str, int, dict[str, Any]]]:
    return {
        "gather-overflow": ("gather", 901, dict(B=8, K=3, pad=0, prefill_frac=1.0, overflow=True)),
        "post-overflow": ("post", 902, dict(B=8, M=4, overflow=True)),
        "combine-overflow": ("combine", 903, dict(B=8, K=3, pad=0, prefill_frac=0.0)),
    }


CASES = _build_cases()
OVERFLOW_CASES = _build_overflow_cases()


def make_inputs(case_id: str) -> dict[str, torch.Tensor]:
    kind, seed, params = {**CASES, **OVERFLOW_CASES}[case_id]
    gen = torch.Generator().manual_seed(seed)
    if kind == "post":
        return _post_step_batch(gen, **params)
    data = _step_batch(gen, **params)
    if case_id == "combine-overflow":
        # More drafts than the query has room for, and more than K.
        data["num_draft_tokens"] += 2
    return data


def run_kernel(kind: str, fn_name_suffix: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run a kernel variant (``""`` = public dispatcher, ``"_torch"``, ``"_cpp"``) on copies."""
    data = {k: v.clone() for k, v in inputs.items()}
    name = {"gather": "gather_prefill_tokens", "combine": "combine_sampled_and_draft_tokens",
            "post": "post_step_update"}[kind]
    getattr(kernels, name + fn_name_suffix)(*[data[a] for a in ARGS[kind]])
    return {k: data[k] for k in OUTPUTS[kind]}


# --------------------------------------------------------------------------- #
# Naive loop oracles, written straight from the spec
# --------------------------------------------------------------------------- #
def oracle(kind: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    d = {k: v.tolist() for k, v in inputs.items()}
    if kind == "gather":
        out = list(d["input_ids"])
        qsl = d["query_start_loc"]
        for b in range(len(d["idx_mapping"])):
            if not d["is_prefilling"][b]:
                continue
            s = d["idx_mapping"][b]
            for j in range(qsl[b + 1] - qsl[b]):
                out[qsl[b] + j] = d["all_token_ids"][s][d["num_computed_tokens"][b] + j]
        return {"input_ids": torch.tensor(out, dtype=I32)}
    if kind == "combine":
        out = list(d["input_ids"])
        qsl = d["query_start_loc"]
        for b in range(len(d["idx_mapping"])):
            if d["is_prefilling"][b]:
                continue
            s, q = d["idx_mapping"][b], qsl[b]
            assert qsl[b + 1] - q == 1 + d["num_draft_tokens"][b]
            out[q] = d["last_sampled_tokens"][s]
            for j in range(d["num_draft_tokens"][b]):
                out[q + 1 + j] = d["draft_tokens"][s][j]
        return {"input_ids": torch.tensor(out, dtype=I32)}
    assert kind == "post"
    table = [list(r) for r in d["all_token_ids"]]
    total, last = list(d["total_len"]), list(d["last_sampled_tokens"])
    for b in range(len(d["idx_mapping"])):
        n = d["num_sampled"][b]
        if n == 0:
            continue
        s = d["idx_mapping"][b]
        t = total[s]
        assert t + n <= MAX_LEN
        for j in range(n):
            table[s][t + j] = d["sampled_token_ids"][b][j]
        total[s] = t + n
        last[s] = d["sampled_token_ids"][b][n - 1]
    return {"all_token_ids": torch.tensor(table, dtype=I32),
            "total_len": torch.tensor(total, dtype=I32),
            "last_sampled_tokens": torch.tensor(last, dtype=I32)}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, f"{what}: {k} dtype {got[k].dtype} != {want[k].dtype}"
        if not torch.equal(got[k], want[k]):
            diff = (got[k] != want[k]).nonzero().tolist()[:10]
            raise AssertionError(f"{what}: {k} differs at {diff}")


def _assert_confined(kind: str, inputs: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> None:
    """Writes stay inside the selected rows' spans / the scheduled slots."""
    if kind in ("gather", "combine"):
        qsl = inputs["query_start_loc"].tolist()
        wanted = inputs["is_prefilling"] if kind == "gather" else ~inputs["is_prefilling"]
        allowed = torch.zeros_like(inputs["input_ids"], dtype=torch.bool)
        for b, sel in enumerate(wanted.tolist()):
            if sel:
                allowed[qsl[b]:qsl[b + 1]] = True
        changed = out["input_ids"] != inputs["input_ids"]
        assert not (changed & ~allowed).any(), f"{kind}: wrote outside selected rows"
        return
    touched = torch.zeros(NUM_SLOTS, dtype=torch.bool)
    for s, n in zip(inputs["idx_mapping"].tolist(), inputs["num_sampled"].tolist()):
        touched[s] = n > 0
    for k in OUTPUTS["post"]:
        changed = out[k] != inputs[k]
        if changed.dim() == 2:
            changed = changed.any(dim=1)
        assert not (changed & ~touched).any(), f"post: {k} changed in a slot with nothing sampled"


# --------------------------------------------------------------------------- #
# Subprocess entry point: run every case through Triton (interpreter)
# --------------------------------------------------------------------------- #
def _triton_main(out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("PDSERVE_USE_TRITON") == "1"
    assert kernels.HAS_TRITON, "triton must be importable in the subprocess"
    assert kernels.select_backend(torch.zeros(1)) == "triton"
    interp = [type(k).__name__ for k in (kernels._gather_prefill_tokens_kernel,
                                         kernels._combine_sampled_and_draft_tokens_kernel,
                                         kernels._post_step_update_kernel)]
    results: dict[str, Any] = {"_meta": {"kernel_types": interp}}
    for case_id, (kind, _, _) in {**CASES, **OVERFLOW_CASES}.items():
        results[case_id] = run_kernel(kind, "", make_inputs(case_id))
    torch.save(results, out_path)


def _compile_main() -> None:
    """Compile every kernel for sm_90 without a GPU (front end through cubin).

    The interpreter accepts code the real compiler may reject (loop bounds,
    scalar/block type mixing), so this covers the CUDA path on a CPU box.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {"BLOCK": 128, "BLOCK_K": 4, "BLOCK_M": 4}
    for fn in (kernels._gather_prefill_tokens_kernel,
               kernels._combine_sampled_and_draft_tokens_kernel,
               kernels._post_step_update_kernel):
        assert type(fn).__name__ == "JITFunction", type(fn)
        sig = {}
        for name in fn.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name == "is_prefilling_ptr":
                sig[name] = "*i1"  # torch.bool tensors are passed as i1 pointers
            else:
                sig[name] = "*i32" if name.endswith("_ptr") else "i32"
        consts = {(fn.arg_names.index(n),): v for n, v in constexprs.items() if n in fn.arg_names}
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                  target=GPUTarget("cuda", 90, 32))
        assert "cubin" in compiled.asm, sorted(compiled.asm)


if __name__ == "__main__":
    if sys.argv[1] == "--compile-sm90":
        _compile_main()
    else:
        _triton_main(sys.argv[1])
    sys.exit(0)


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #
import pytest  # noqa: E402


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not kernels.HAS_TRITON:
        pytest.skip("triton is not importable: only the torch reference is tested")
    out = tmp_path_factory.mktemp("triton") / "results.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", PDSERVE_USE_TRITON="1",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(out)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    # A negative code is a signal: -11 (SIGSEGV) usually means a kernel wrote
    # out of bounds, since the interpreter does no bounds checking.
    assert proc.returncode == 0, f"triton subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    results = torch.load(out)
    assert results["_meta"]["kernel_types"] == ["InterpretedFunction"] * 3, results["_meta"]
    return results


def test_kernels_compile_for_sm90(tmp_path: Path) -> None:
    """The CUDA path can't run here, but it must at least compile."""
    if not kernels.HAS_TRITON:
        pytest.skip("triton is not importable")
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--compile-sm90"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"sm_90 compile failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_torch_reference_matches_oracle(case_id: str) -> None:
    kind = CASES[case_id][0]
    inputs = make_inputs(case_id)
    got = run_kernel(kind, "_torch", inputs)
    _assert_equal(got, oracle(kind, inputs), f"{case_id} torch vs oracle")
    _assert_confined(kind, inputs, got)


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_triton_matches_oracle_and_torch(case_id: str, triton_results: dict[str, Any]) -> None:
    kind = CASES[case_id][0]
    inputs = make_inputs(case_id)
    got = triton_results[case_id]
    _assert_equal(got, oracle(kind, inputs), f"{case_id} triton vs oracle")
    _assert_equal(got, run_kernel(kind, "_torch", inputs), f"{case_id} triton vs torch")
    _assert_confined(kind, inputs, got)


@pytest.mark.parametrize("case_id", sorted(OVERFLOW_CASES))
def test_precondition_violations_are_clamped_identically(case_id: str, triton_results: dict[str, Any]) -> None:
    kind = OVERFLOW_CASES[case_id][0]
    inputs = make_inputs(case_id)
    ref = run_kernel(kind, "_torch", inputs)
    _assert_confined(kind, inputs, ref)
    _assert_equal(triton_results[case_id], ref, f"{case_id} triton vs torch")


@pytest.mark.parametrize("case_id", sorted(set(CASES) | set(OVERFLOW_CASES)))
def test_cpp_matches_oracle_and_torch(case_id: str) -> None:
    """The C++ loops the engine runs on CPU: the oracle's results, and the torch reference's
    clamping where a precondition is violated."""
    kind = (CASES.get(case_id) or OVERFLOW_CASES[case_id])[0]
    inputs = make_inputs(case_id)
    got = run_kernel(kind, "_cpp", inputs)
    _assert_equal(got, run_kernel(kind, "_torch", inputs), f"{case_id} cpp vs torch")
    if case_id in CASES:
        _assert_equal(got, oracle(kind, inputs), f"{case_id} cpp vs oracle")
    _assert_confined(kind, inputs, got)


def test_public_dispatch_on_cpu_uses_cpp_for_int32_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_USE_TRITON", raising=False)
    assert fused_ops.enable()
    assert kernels.select_backend(torch.zeros(2, dtype=I32)) == "cpp"
    assert kernels.select_backend(torch.zeros(2, dtype=I32), torch.zeros(2)) == "torch"  # not all int32
    assert kernels.select_backend(torch.zeros(2, 2, dtype=I32).t()) == "torch"           # not contiguous
    monkeypatch.setenv("PDSERVE_USE_TRITON", "0")
    assert kernels.select_backend(torch.zeros(2, dtype=I32)) == "cpp"


def test_cpp_refuses_a_slot_outside_the_tables() -> None:
    inputs = make_inputs("post-B8-M4")
    inputs["idx_mapping"][0] = inputs["all_token_ids"].shape[0]
    with pytest.raises(RuntimeError, match="is not a slot"):
        run_kernel("post", "_cpp", inputs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA to run the compiled Triton kernels")
def test_compiled_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU box: the dispatcher picks compiled Triton for CUDA tensors."""
    monkeypatch.delenv("PDSERVE_USE_TRITON", raising=False)
    assert kernels.select_backend(torch.zeros(1, device="cuda")) == "triton"
    for case_id, (kind, _, _) in {**CASES, **OVERFLOW_CASES}.items():
        inputs = make_inputs(case_id)
        got = run_kernel(kind, "", {k: v.cuda() for k, v in inputs.items()})
        got = {k: v.cpu() for k, v in got.items()}
        want = oracle(kind, inputs) if case_id in CASES else run_kernel(kind, "_torch", inputs)
        _assert_equal(got, want, f"{case_id} cuda triton")


def test_cases_exercise_the_interesting_paths() -> None:
    """Guard against the generator drifting into trivial batches."""
    saw = {"prefill": False, "decode": False, "pad": False, "zero_sampled": False, "drafts": False}
    for case_id, (kind, _, _) in CASES.items():
        d = make_inputs(case_id)
        if kind != "post":
            saw["prefill"] |= bool(d["is_prefilling"].any())
            saw["decode"] |= bool((~d["is_prefilling"]).any())
            saw["pad"] |= d["input_ids"].shape[0] > int(d["query_start_loc"][-1])
            saw["drafts"] |= bool(((~d["is_prefilling"]) & (d["num_draft_tokens"] > 0)).any())
        else:
            saw["zero_sampled"] |= bool((d["num_sampled"] == 0).any())
    assert all(saw.values()), saw
    overflow = make_inputs("post-overflow")
    t = overflow["total_len"][overflow["idx_mapping"].long()]
    assert ((t + overflow["num_sampled"]) > MAX_LEN).any()


def test_public_dispatch_on_cpu_uses_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_USE_TRITON", raising=False)
    assert kernels.select_backend(torch.zeros(1)) == "torch"
    for case_id in ("gather-B8-K3-pad5", "combine-B8-K1-pad0", "post-B8-M4"):
        kind = CASES[case_id][0]
        inputs = make_inputs(case_id)
        _assert_equal(run_kernel(kind, "", inputs), oracle(kind, inputs), f"{case_id} dispatcher")


def test_backend_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_USE_TRITON", "0")
    assert kernels.select_backend(torch.zeros(1)) == "torch"
    monkeypatch.setenv("PDSERVE_USE_TRITON", "1")
    assert kernels.select_backend(torch.zeros(1)) == ("triton" if kernels.HAS_TRITON else "torch")


def test_unselected_rows_untouched() -> None:
    """Explicit hand-written batch: decode rows in gather, prefill rows in
    combine, n == 0 rows and unscheduled slots in post_step_update."""
    all_ids = torch.arange(4 * 8, dtype=I32).reshape(4, 8)
    idx = torch.tensor([2, 0], dtype=I32)
    qsl = torch.tensor([0, 3, 5], dtype=I32)  # row0: 3 tokens, row1: 2 tokens
    is_pf = torch.tensor([True, False])
    inp = torch.full((7,), -1, dtype=I32)  # 2 padding positions at the end
    kernels.gather_prefill_tokens_torch(inp, all_ids, idx, qsl, torch.tensor([4, 6], dtype=I32), is_pf)
    assert inp.tolist() == [20, 21, 22, -1, -1, -1, -1]

    last = torch.tensor([100, 101, 102, 103], dtype=I32)
    drafts = torch.tensor([[10, 11], [12, 13], [14, 15], [16, 17]], dtype=I32)
    kernels.combine_sampled_and_draft_tokens_torch(
        inp, last, drafts, torch.tensor([2, 1], dtype=I32), idx, qsl, is_pf)
    assert inp.tolist() == [20, 21, 22, 100, 10, -1, -1]

    total = torch.tensor([5, 6, 7, 3], dtype=I32)
    before = (all_ids.clone(), total.clone(), last.clone())
    sampled = torch.tensor([[90, 91], [92, 93]], dtype=I32)
    kernels.post_step_update_torch(all_ids, total, last, sampled, torch.tensor([0, 2], dtype=I32), idx)
    assert total.tolist() == [7, 6, 7, 3]
    assert last.tolist() == [93, 101, 102, 103]
    assert all_ids[0].tolist() == [0, 1, 2, 3, 4, 92, 93, 7]
    for s in (1, 2, 3):  # slot 2 was scheduled but sampled nothing
        assert torch.equal(all_ids[s], before[0][s])


def test_empty_batch_is_a_no_op() -> None:
    all_ids = torch.zeros(2, 4, dtype=I32)
    empty = torch.zeros(0, dtype=I32)
    inp = torch.full((3,), 7, dtype=I32)
    kernels.gather_prefill_tokens(inp, all_ids, empty, torch.zeros(1, dtype=I32), empty,
                                  torch.zeros(0, dtype=torch.bool))
    kernels.combine_sampled_and_draft_tokens(inp, torch.zeros(2, dtype=I32), torch.zeros(2, 1, dtype=I32),
                                             empty, empty, torch.zeros(1, dtype=I32),
                                             torch.zeros(0, dtype=torch.bool))
    kernels.post_step_update(all_ids, torch.zeros(2, dtype=I32), torch.zeros(2, dtype=I32),
                             torch.zeros(0, 4, dtype=I32), empty, empty)
    assert inp.tolist() == [7, 7, 7] and not all_ids.any()
