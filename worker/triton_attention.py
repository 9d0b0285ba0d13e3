"""Paged attention as a Triton kernel (CUDA; tests run it on CPU with `TRITON_INTERPRET=1`).

Same contract as the C++ kernel (worker/csrc/paged_attention.cpp): one program per (row, query
token, head) walks the row's keys through its block table in tiles of `BLOCK_N`, with an online
softmax, reading the paged cache in place. Row b's query i sits at position
`seq_len - query_len + i` and sees keys j <= that position (and j > position - window). The torch
reference is worker/attention.py:reference_attention.
"""
from __future__ import annotations

import torch

from worker.kernels import HAS_TRITON, _require_triton, tl, triton

if HAS_TRITON:

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, q_start_ptr, q_len_ptr, seq_len_ptr,
        q_stride_t, q_stride_h, kv_stride_slot, o_stride_t, bt_stride, scale, window,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        row = tl.program_id(0)
        qi = tl.program_id(1)
        head = tl.program_id(2)
        q_len = tl.load(q_len_ptr + row)
        active = qi < q_len
        q0 = tl.load(q_start_ptr + row)
        pos = tl.load(seq_len_ptr + row) - q_len + qi
        kv_head = head // GROUP
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        io_mask = dmask & (d * 0 + qi < q_len)  # a vector mask: the interpreter takes no scalar in a mask
        q_off = (q0 + qi).to(tl.int64) * q_stride_t + head * q_stride_h
        q = tl.load(q_ptr + q_off + d, mask=io_mask, other=0.0).to(tl.float32) * scale
        lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
        hi = tl.where(active, pos + 1, lo)  # an inactive program walks no keys
        m_i = tl.full((), float("-inf"), tl.float32)
        l_i = tl.full((), 0.0, tl.float32)
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            valid = j < hi
            blk = tl.load(bt_ptr + row * bt_stride + j // BLOCK_SIZE, mask=valid, other=0)
            slot = blk.to(tl.int64) * BLOCK_SIZE + j % BLOCK_SIZE
            kv_off = slot[:, None] * kv_stride_slot + kv_head * HEAD_DIM + d[None, :]
            kv_mask = valid[:, None] & dmask[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.where(valid, tl.sum(k * q[None, :], 1), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            m_i = m_new
        out = acc / tl.where(active, l_i, 1.0)
        o_off = (q0 + qi).to(tl.int64) * o_stride_t + head * HEAD_DIM
        tl.store(out_ptr + o_off + d, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start: torch.Tensor, query_len: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                    sliding_window: int | None, scale: float, out: torch.Tensor, max_query_len: int) -> None:
    """q, out: [T, H, D]; k_cache, v_cache: [slots, Hkv, D]; the index tensors int32 as in the C++ kernel."""
    _require_triton()
    num_rows, heads, dim = seq_lens.shape[0], q.shape[1], q.shape[2]
    if num_rows == 0 or max_query_len == 0:
        return
    grid = (num_rows, max_query_len, heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_table, query_start, query_len, seq_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), out.stride(0), block_table.stride(0), scale,
        sliding_window or 0,
        GROUP=heads // k_cache.shape[1], HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_N=64,
        BLOCK_SIZE=block_size,
    )
