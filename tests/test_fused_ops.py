"""The C++ elementwise ops of the decoder layer (worker/csrc/fused_ops.cpp) against their torch references,
on the shapes and strides the model hands them; and the fallbacks (another dtype, the switch off,
a torch.compile trace). End to end, every exactness test vs transformers runs them too."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker import fused_ops


@pytest.fixture(scope="module", autouse=True)
def built():
    if not fused_ops.enable():
        pytest.fail("the fused ops did not build (a C++ compiler is part of the set-up)")


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rope_is_bit_identical_on_a_slice_of_the_qkv_projection(tokens):
    """As the model calls it: q and k heads sliced out of the stacked projection (strided rows),
    cos and sin unbound from one [T, 2, 1, D] lookup (strided too)."""
    g = torch.Generator().manual_seed(tokens)
    heads = torch.randn(tokens, 4 + 2 * 2, 64, generator=g)
    cos, sin = torch.randn(tokens, 2, 1, 64, generator=g).unbind(1)
    qk = heads[:, :6]
    assert tokens == 1 or not (qk.is_contiguous() or cos.is_contiguous())  # (one row is contiguous anyway)
    assert torch.equal(torch.ops.pdserve_fused.rope(qk, cos, sin), reference_rope(qk, cos, sin))
    assert torch.equal(fused_ops.rope(qk, cos, sin), reference_rope(qk, cos, sin))


@pytest.mark.parametrize("shape", [(1, 256), (33, 256), (5, 3, 24)])
def test_rms_norm_matches_torch(shape):
    """Hidden rows, and Qwen3's per-head q/k norm ([T, heads, head_dim], normalised over head_dim)."""
    g = torch.Generator().manual_seed(sum(shape))
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    out = torch.ops.pdserve_fused.rms_norm(x, w, 1e-6)
    ref = F.rms_norm(x, (shape[-1],), w, 1e-6)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)


def test_rms_norm_takes_strided_rows():
    x = torch.randn(6, 512)[:, :256]  # rows 512 apart, each contiguous
    w = torch.randn(256)
    torch.testing.assert_close(fused_ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (256,), w, 1e-5), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_add_rms_norm_is_the_add_then_rms_norm_bit_for_bit(rows):
    """A decoder layer's residual add and the norm after it: the sum is torch's `x + residual`, the
    norm the rms_norm op's, to the bit (the attention's output and a residual of strided rows too)."""
    g = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 512, generator=g)[:, :256], torch.randn(rows, 256, generator=g) * 4
    w = torch.randn(256, generator=g)
    total, normed = torch.ops.pdserve_fused.add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(total, x + residual)
    assert torch.equal(normed, torch.ops.pdserve_fused.rms_norm(x + residual, w, 1e-6))
    torch.testing.assert_close(normed, F.rms_norm(x + residual, (256,), w, 1e-6), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 9])
def test_qk_norm_rope_is_the_norms_then_rope_bit_for_bit(tokens):
    """Qwen3's q_norm and k_norm, then the rotation, on the q and k heads sliced out of the stacked
    projection: the same bits as the rms_norm and rope ops one after the other."""
    g = torch.Generator().manual_seed(tokens)
    heads = torch.randn(tokens, 16 + 2 * 8, 128, generator=g) * 2
    qw, kw = torch.randn(128, generator=g), torch.randn(128, generator=g)
    cos, sin = torch.randn(tokens, 2, 1, 128, generator=g).unbind(1)
    qk = heads[:, :24]
    out = torch.ops.pdserve_fused.qk_norm_rope(qk, 16, qw, kw, 1e-6, cos, sin)
    ref = torch.cat([fused_ops.rope(fused_ops.rms_norm(qk[:, :16], qw, 1e-6), cos, sin),
                     fused_ops.rope(fused_ops.rms_norm(qk[:, 16:], kw, 1e-6), cos, sin)], dim=1)
    assert torch.equal(out, ref)
    expanded = torch.cat([F.rms_norm(qk[:, :16], (128,), qw, 1e-6), F.rms_norm(qk[:, 16:], (128,), kw, 1e-6)], 1)
    torch.testing.assert_close(out, reference_rope(expanded, cos, sin), rtol=2e-6, atol=2e-5)


@pytest.mark.parametrize("n", [13, 704, 3072])
def test_silu_and_mul_matches_torch(n):
    """SiLU(gate) * up within fp32 rounding (vectorised lanes and the scalar tail), including
    +-0, large magnitudes of either sign, +-inf and NaN."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(6, 2 * n, generator=g) * 6
    x[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, float("inf"), float("-inf"), float("nan"), 88.0])
    out = torch.ops.pdserve_fused.silu_and_mul(x)
    ref = F.silu(x[:, :n]) * x[:, n:]
    # exp(-100) underflows to 0 here where torch keeps a denormal: an absolute 1e-38 at most.
    torch.testing.assert_close(out, ref, rtol=4e-7, atol=1e-38, equal_nan=True)  # a few ulps
    torch.testing.assert_close(fused_ops.silu_and_mul(x), out, rtol=0, atol=0, equal_nan=True)


def test_write_kv_is_index_copy():
    g = torch.Generator().manual_seed(0)
    heads = torch.randn(5, 4 + 2 * 2, 32, generator=g)
    k, v = heads[:, 4:6], heads[:, 6:]  # strided views of the projection, as the layer passes them
    slots = torch.tensor([3, 17, 0, 63, 40])
    caches = [torch.zeros(64, 2, 32) for _ in range(4)]
    torch.ops.pdserve_fused.write_kv(caches[0], caches[1], slots, k, v)
    caches[2].index_copy_(0, slots, k)
    caches[3].index_copy_(0, slots, v)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.pdserve_fused.write_kv(caches[0], caches[1], torch.tensor([0, 1, 2, 3, 64]), k, v)
    bf16 = [c.bfloat16() for c in caches[:2]]  # a bf16 cache: index_copy_ after a cast
    fused_ops.write_kv(bf16[0], bf16[1], slots, k, v)
    assert torch.equal(bf16[0], caches[2].bfloat16()) and torch.equal(bf16[1], caches[3].bfloat16())


def test_bad_inputs_are_refused_by_the_op_and_routed_around_by_the_wrappers():
    x = torch.randn(4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.pdserve_fused.rope(x, torch.randn(4, 1, 64), torch.randn(4, 1, 64))
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.pdserve_fused.rope(x.float(), torch.randn(4, 64), torch.randn(4, 64))
    # A bf16 rope (a bf16 model) and an fp16 norm go to the torch expression.
    c, s = torch.randn(4, 1, 64, dtype=torch.bfloat16), torch.randn(4, 1, 64, dtype=torch.bfloat16)
    assert torch.equal(fused_ops.rope(x, c, s), reference_rope(x, c, s))
    half, w16 = x.half(), torch.randn(64, dtype=torch.float16)
    assert torch.equal(fused_ops.rms_norm(half, w16, 1e-6), F.rms_norm(half, (64,), w16, 1e-6))
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.pdserve_fused.rms_norm(half, w16, 1e-6)


def test_bf16_rms_norm_of_the_drafter_is_torch_within_its_rounding():
    """The bf16 MTP drafter's norms: computed in fp32 and rounded once, as torch's bf16 rms_norm."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 256, generator=g).bfloat16(), torch.randn(256, generator=g).bfloat16()
    out = torch.ops.pdserve_fused.rms_norm(x, w, 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.rms_norm(x, (256,), w, 1e-6), rtol=1e-2, atol=1e-2)


def test_switched_off_and_under_compile_it_is_the_torch_expression(monkeypatch):
    x = torch.randn(3, 4, 16)
    cos, sin = torch.randn(3, 2, 1, 16).unbind(1)
    monkeypatch.setattr(fused_ops, "_enabled", False)
    assert torch.equal(fused_ops.rope(x, cos, sin), reference_rope(x, cos, sin))
    monkeypatch.setattr(fused_ops, "_enabled", True)
    compiled = torch.compile(fused_ops.rope, fullgraph=True)  # no custom op in the graph: it traces
    torch.testing.assert_close(compiled(x, cos, sin), reference_rope(x, cos, sin))


@pytest.mark.parametrize("vocab", [1, 15, 16, 384, 4099])
def test_argmax_is_torch_argmax(vocab, monkeypatch):
    """Random rows, and the edge cases torch defines: ties (the first), a row of -inf (index 0);
    NaN counts as -inf (torch's argmax would pick the first NaN); vocab sizes off the 16-wide
    vector; strided rows (a slice of a wider buffer)."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(40, vocab + 3, generator=g)[:, :vocab]
    x[1] = float("-inf")
    x[2] = 0.5
    if vocab > 9:
        x[3, 9] = x[3, vocab - 1] = 1e6               # a tie: the first
        x[4, 7] = x[4, vocab - 2] = float("nan")     # NaN is -inf here
        x[5, vocab - 1] = float("inf")
        x[6] = float("nan")                          # nothing but NaN: 0
        x[7, : vocab // 2] = float("nan")
    want = x.nan_to_num(nan=float("-inf"), posinf=float("inf")).argmax(dim=-1)
    assert torch.equal(fused_ops.argmax(x), want)
    assert torch.equal(torch.ops.pdserve_fused.argmax(x.contiguous()), want)
    with monkeypatch.context() as m:  # the torch path
        m.setattr(fused_ops, "_enabled", False)
        assert torch.equal(fused_ops.argmax(x), want)


# How far a uniform may be from a boundary of two tokens' running mass and still count as a float tie
# there: the sums of a few hundred fp32 probabilities differ in about the last bits between the two.
TIE_EPS = 1e-5


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_rejection_verify_matches_its_torch_reference(draft_vocab, monkeypatch):
    """The C++ rejection sampler against the torch loop in fused_ops (same uniforms): rows with 0-3
    drafts, drafts taken from q (mostly accepted) or from p's tail (mostly rejected), a draft
    vocabulary (q zero elsewhere), temperatures apart from 1; a row where q equals p (a rejection
    then falls back to p). The drafts accepted are equal everywhere; the token after them is equal
    except where the row's uniform lies at a boundary of two tokens' running mass, which float
    rounding may put on either side: the reference, its uniform nudged by TIE_EPS, must then pick
    the C++ token."""
    g = torch.Generator().manual_seed(11)
    vocab, rows = 300, 64
    ks = torch.randint(0, 4, (rows,), generator=g, dtype=torch.int32)
    total = int(ks.sum())
    logits = 3 * torch.randn(total + rows, vocab, generator=g)
    ids = torch.arange(0, vocab, 2) if draft_vocab else None
    width = vocab // 2 if draft_vocab else vocab
    q = torch.softmax(2 * torch.randn(total, width, generator=g), dim=-1)
    drafts = torch.multinomial(q, 1, generator=g).flatten()
    drafts = (ids[drafts] if draft_vocab else drafts).to(torch.int32)
    drafts[::3] = torch.randint(0, vocab, drafts[::3].shape, generator=g, dtype=torch.int32)
    temperature = torch.rand(rows, generator=g) + 0.5
    if not draft_vocab and ks[0] > 0:  # row 0's first draft distribution is p itself
        q[0] = torch.softmax(logits[0] / temperature[0], dim=-1)
    accept_u, final_u = torch.rand(total, generator=g), torch.rand(rows, generator=g)
    args = (logits, temperature, ks, drafts, q, ids, accept_u, final_u)
    fused = fused_ops.rejection_verify(*args)
    monkeypatch.setattr(fused_ops, "_enabled", False)
    reference = fused_ops.rejection_verify(*args)
    assert fused.shape == (rows, 2)
    assert torch.equal(fused[:, 0], reference[:, 0])
    for r in torch.nonzero(fused[:, 1] != reference[:, 1]).flatten().tolist():
        nudged = set()
        for eps in (-TIE_EPS, TIE_EPS):
            u = final_u.clone()
            u[r] += eps
            nudged.add(int(fused_ops.rejection_verify(logits, temperature, ks, drafts, q, ids, accept_u, u)[r, 1]))
        assert int(fused[r, 1]) in nudged, (f"row {r}: C++ token {int(fused[r, 1])}, reference {int(reference[r, 1])}, "
                                            f"and no draw within {TIE_EPS} of row's uniform gives the C++ one")
    accepted = fused[:, 0]
    assert 0 < int(accepted.sum()) < total and (accepted <= ks).all()
