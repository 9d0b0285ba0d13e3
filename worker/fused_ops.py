"""The decoder layer's elementwise work as one op each on the CPU (RMSNorm, with the residual add
before it; rotary embedding, with Qwen3's per-head norms before it; SiLU-and-mul; the K/V write),
and an argmax (`worker/csrc/fused_ops.cpp`); the same library holds the C++ token-bookkeeping
kernels that worker/kernels.py dispatches to.

A decode step on a CPU is a few rows, so the decoder layer's elementwise work costs what its
dispatches cost: RMSNorm alone is seven torch ops. And torch's CPU argmax over the vocabulary
tracks its index element by element, several times slower than a vectorised pass.
For fp32 CPU tensors in eager mode each function here is one C++ op doing the same arithmetic in
one pass (bf16 too for RMSNorm); otherwise (another dtype or device, a torch.compile trace --
Inductor fuses these itself --, `PDSERVE_FUSED_OPS=0`, or no compiler to build with) it runs the
torch expression, which is also the reference the tests compare the C++ ops with. The engine
builds the ops at start (`enable`), never inside a step.

Non-finite logits, one rule in every sampling path (argmax, the sampler's draws, rejection_verify,
MTP drafting; torch and C++): NaN counts as -inf and +inf as the largest float32 (tokens at +inf
share the mass), after penalties and temperature; a position with no finite logit has no mass and
gives token 0 (argmax and the draws alike). So a sampled id is always in [0, vocab).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import settings
from worker import cpp_build

# Strict IEEE arithmetic: no reassociation, no contracted multiply-adds (see the source's header).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]

_enabled = False
_FLT_MAX = torch.finfo(torch.float32).max


def enable() -> bool:
    """Build (or load) the C++ ops unless PDSERVE_FUSED_OPS=0; whether they are in use."""
    global _enabled
    if not _enabled and settings.FUSED_OPS.get():
        _enabled = cpp_build.build("fused_ops.cpp", CFLAGS, "fused elementwise ops")
    return _enabled


def ints_on_cpu(*tensors: torch.Tensor) -> bool:
    """Whether the C++ token-bookkeeping ops (worker/kernels.py) take these: contiguous int32 CPU tensors."""
    return _enabled and all(t.dtype == torch.int32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _fused(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    return _enabled and x.dtype in dtypes and x.device.type == "cpu" and not torch.compiler.is_compiling()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2, -1) + eps)); the reference is torch's own rms_norm. (bf16 too:
    RMSNorm calls this for bf16 only where it need not match transformers, the MTP drafter.)"""
    if _fused(x, (torch.float32, torch.bfloat16)) and weight.dtype == x.dtype and x.stride(-1) == 1:
        return torch.ops.pdserve_fused.rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual)): a decoder layer's residual add and the norm after it."""
    if (_fused(x) and residual.dtype == weight.dtype == torch.float32 and x.shape == residual.shape
            and x.stride(-1) == 1 and residual.stride(-1) == 1):
        return torch.ops.pdserve_fused.add_rms_norm(x, residual, weight, eps)
    total = x + residual
    return total, rms_norm(total, weight, eps)


def qk_norm_rope(x: torch.Tensor, num_q: int, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, q + k heads, head_dim]: the first num_q heads RMS-normed by q_weight, the rest by
    k_weight (Qwen3's q_norm and k_norm), then all rotated (rope)."""
    if _fused(x) and x.dim() == 3 and x.stride(-1) == 1 and q_weight.dtype == k_weight.dtype == torch.float32:
        return torch.ops.pdserve_fused.qk_norm_rope(x, num_q, q_weight, k_weight, eps, cos, sin)
    normed = torch.cat([rms_norm(x[:, :num_q], q_weight, eps), rms_norm(x[:, num_q:], k_weight, eps)], dim=1)
    return rope(normed, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for x = [gate | up] along the last dimension (the gated MLP's activation)."""
    if _fused(x) and x.dim() == 2 and x.stride(-1) == 1:
        return torch.ops.pdserve_fused.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k_cache[slots] = k and v_cache[slots] = v (caches [slots, kv heads, head_dim], k and v [T, kv heads,
    head_dim], slots int64 [T])."""
    if (_fused(k) and k_cache.dtype == v.dtype == torch.float32 and k_cache.is_contiguous()
            and v_cache.is_contiguous() and k.stride(-1) == 1 and v.stride(-1) == 1):
        torch.ops.pdserve_fused.write_kv(k_cache, v_cache, slots, k, v)
        return
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated as transformers' apply_rotary_pos_emb; cos/sin [T, 1, head_dim]."""
    if _fused(x) and x.dim() == 3 and x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1:
        return torch.ops.pdserve_fused.rope(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """The non-finite rule (module docstring) applied: NaN -> -inf, +inf -> the largest float32."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=_FLT_MAX, neginf=float("-inf"))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) of [rows, vocab] logits (int64): the first of equal maxima, NaN counting
    as -inf (torch's own argmax picks the first NaN)."""
    if _fused(logits) and logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[-1] > 0:
        return torch.ops.pdserve_fused.argmax(logits)
    return logits.masked_fill(logits.isnan(), float("-inf")).argmax(dim=-1)


def rejection_verify(logits: torch.Tensor, temperature: torch.Tensor, num_drafts: torch.Tensor, drafts: torch.Tensor,
                     q: torch.Tensor, vocab_ids: torch.Tensor | None, accept_u: torch.Tensor,
                     final_u: torch.Tensor) -> torch.Tensor:
    """Standard rejection sampling of independently drawn drafts at plain temperature ([rows, 2]
    int64: drafts accepted, then the token after them); see rejection_verify in fused_ops.cpp.
    logits [sum(1 + k), V]; temperature [rows]; num_drafts [rows] and drafts [sum k] int32; q
    [sum k, Vd] over `vocab_ids` (None: the whole vocabulary); accept_u [sum k]; final_u [rows]."""
    if _fused(logits) and logits.is_contiguous():
        ids = vocab_ids if vocab_ids is not None else torch.empty(0, dtype=torch.long)
        return torch.ops.pdserve_fused.rejection_verify(logits, temperature, num_drafts, drafts, q.contiguous(), ids,
                                                        accept_u, final_u.contiguous())
    vocab = logits.shape[1]
    if vocab_ids is not None:
        q = torch.zeros(q.shape[0], vocab, dtype=q.dtype, device=q.device).index_copy_(1, vocab_ids, q)
    out = torch.empty(len(num_drafts), 2, dtype=torch.long)
    pos = start = 0
    for r, k in enumerate(num_drafts.tolist()):
        probs = torch.softmax(finite_logits(logits[pos : pos + k + 1].float() / temperature[r]), dim=-1).nan_to_num(0.0)
        m, dist = 0, probs[k]
        while m < k:
            d = int(drafts[start + m])
            if accept_u[start + m] * q[start + m, d] >= probs[m, d]:
                residual = (probs[m] - q[start + m]).clamp_min(0.0)
                dist = residual if residual.sum() > 0 else probs[m]
                break
            m += 1
        support = torch.nonzero(dist > 0).squeeze(1)
        running = dist[support].cumsum(0)
        pick = int(torch.searchsorted(running, final_u[r] * dist.sum(), right=True))
        # (no support: no finite logit at that position, token 0 by the non-finite rule)
        out[r, 0], out[r, 1] = m, int(support[min(pick, len(support) - 1)]) if len(support) else 0
        pos, start = pos + k + 1, start + k
    return out
