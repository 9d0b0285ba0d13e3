"""Paged attention, driven by a per-step context.

The runner builds one `AttentionContext` per step; every layer then writes its new K/V into the
paged cache and attends. The model only calls `attend(layer, q, k, v)` and never sees blocks.

How a row attends depends on its query length:
- short rows (decode, speculative verify: at most `PAGED_MAX_QUERY` tokens) go to a paged kernel
  that reads the row's blocks in place through its block table: C++ on CPU
  (worker/csrc/paged_attention.cpp), Triton on CUDA (worker/triton_attention.py);
- prefill chunks attend causally over their own K/V when nothing is cached before them (no cache
  read, no mask): the C++ kernel on CPU (worker/csrc/prefill_attention.cpp) where it takes the
  tensors, else SDPA; a chunk after cached tokens runs SDPA over its context gathered from the
  cache (below).
`reference_attention` (dense gather + host-built mask, every row alike) is the torch reference
the kernels are tested against, and the fallback where no kernel can run (`PDSERVE_ATTENTION=torch`
forces it).

A compiled model cannot trace through this object, so it calls the `pdserve::attention` custom
op instead, which finds the step's context through `forward_context` (as vLLM's forward context).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine import settings
from worker import fused_ops
from worker.input_batch import StepLayout

PAGED_MAX_QUERY = 16
# A chunk after a cached prefix attends the prefix and its own tokens in two SDPA calls merged by
# log-sum-exp (below) from this many queries on: one masked call over prefix and chunk also computes
# the masked half of the chunk's scores against itself, which the split saves on long chunks; on short
# ones the second call and the merge cost more than that wasted half (measured on one core).
SPLIT_MIN_QUERY = 256


def default_backend(device: torch.device) -> str:
    """"cpp", "triton" or "torch" (the reference), from PDSERVE_ATTENTION (auto|cpp|triton|torch)."""
    choice = settings.ATTENTION.get()
    if choice != "auto":
        return choice
    if device.type == "cuda":
        from worker.kernels import HAS_TRITON

        return "triton" if HAS_TRITON else "torch"
    from worker import cpu_attention

    if not cpu_attention.available():
        return "torch"
    cpu_attention.prefill_available()  # built now too, not in the first step that prefills
    return "cpp"


@dataclass
class PrefillRow:
    """A long row attended with SDPA: tokens [start, end) of the step, `num_computed` cached before."""

    start: int
    end: int
    kv_slots: torch.Tensor | None   # cache slots of what the row attends beyond its own K/V (see `mask`)
    mask: torch.Tensor | None       # [q, kv] bool over kv_slots = the whole context; None: no mask (below)
    # With no mask, kv_slots (when set) is the cached prefix [0, num_computed): the row attends it
    # without a mask and its own K/V causally, and the two are merged by their log-sum-exps (on CPU,
    # chunks of at least SPLIT_MIN_QUERY tokens).


class CacheWriter:
    """Where a step's tokens go in the paged cache: `write` puts a layer's K/V there, attending nothing.

    `tap` (worker/kv_tap.py), when the runner sets one, is called with the layer index right after
    each layer's K/V write: a prefill engine pushes the layer to the decode instance from there."""

    tap: Callable[[int], None] | None = None

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layout: StepLayout, block_size: int,
                 device: torch.device) -> None:
        self.kv_caches, self.layout, self.block_size = kv_caches, layout, block_size
        positions = layout.positions()
        row = np.repeat(np.arange(len(layout.query_lens)), layout.query_lens)
        slot_mapping = layout.block_tables[row, positions // block_size].astype(np.int64) * block_size
        self.positions = torch.from_numpy(positions).to(device)
        self.slot_mapping = torch.from_numpy(slot_mapping + positions % block_size).to(device)

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's K/V [T, Hkv, D] of layer `layer_idx` into the cache (then the tap hears of it)."""
        k_cache, v_cache = self.kv_caches[layer_idx]
        fused_ops.write_kv(k_cache, v_cache, self.slot_mapping, k, v)
        if self.tap is not None:
            self.tap(layer_idx)


class AttentionContext(CacheWriter):
    """Everything attention needs for one step, computed once and shared by all layers."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layout: StepLayout, block_size: int,
                 device: torch.device, sliding_window: int | None = None, backend: str | None = None) -> None:
        super().__init__(kv_caches, layout, block_size, device)
        self.window = sliding_window
        self.backend = backend or default_backend(device)
        bt = layout.block_tables
        if self.backend == "torch":
            self.reference = ReferenceLayout(layout, block_size, device, sliding_window, kv_caches[0][0].dtype)
            return
        short = layout.query_lens <= PAGED_MAX_QUERY
        q_len = np.where(short, layout.query_lens, 0).astype(np.int32)
        self.max_short_query = int(q_len.max())
        if self.max_short_query:
            def dev(a: np.ndarray) -> torch.Tensor:
                return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)

            self.paged_args = (dev(bt), dev(layout.query_start_loc[:-1]), dev(q_len), dev(layout.seq_lens))
        self.prefill_rows = [self._prefill_row(r, device) for r in np.nonzero(~short)[0].tolist()]

    def _prefill_row(self, r: int, device: torch.device) -> PrefillRow:
        lay, window = self.layout, self.window
        start, end = int(lay.query_start_loc[r]), int(lay.query_start_loc[r + 1])
        computed, seq_len = int(lay.num_computed[r]), int(lay.seq_lens[r])
        split = device.type == "cpu" and end - start >= SPLIT_MIN_QUERY
        unmasked = (window is None or seq_len <= window) and (computed == 0 or split)
        j = np.arange(computed if unmasked else seq_len)
        slots = lay.block_tables[r, j // self.block_size].astype(np.int64) * self.block_size + j % self.block_size
        if unmasked:
            return PrefillRow(start, end, torch.from_numpy(slots).to(device) if computed else None, None)
        keys = torch.arange(seq_len, device=device)
        queries = torch.arange(computed, seq_len, device=device)[:, None]
        mask = keys[None, :] <= queries
        if window is not None:
            mask &= keys[None, :] > queries - window
        return PrefillRow(start, end, torch.from_numpy(slots).to(device), mask)

    def paged_inputs(self, layer_idx: int) -> tuple | None:
        """What a fused C++ layer needs to write its K/V and attend with the C++ paged kernel itself
        (the MTP drafter's, worker/models/mtp.py): (k_cache, v_cache, block_table, query_start,
        query_len, seq_lens, block_size, sliding_window), or None where this step cannot go that way
        (another backend, a long row, non-fp32 caches)."""
        k_cache, v_cache = self.kv_caches[layer_idx]
        if self.backend != "cpp" or self.prefill_rows or not self.max_short_query or k_cache.dtype != torch.float32:
            return None
        return (k_cache, v_cache, *self.paged_args, self.block_size, self.window or 0)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for this step's tokens. Returns [T, H, D]."""
        k_cache, v_cache = self.kv_caches[layer_idx]
        if q.dtype != k_cache.dtype:  # a lower-precision MTP drafter: attend in the cache's dtype
            return self.attend(layer_idx, q.to(k_cache.dtype), k.to(k_cache.dtype), v.to(k_cache.dtype)).to(q.dtype)
        self.write(layer_idx, k, v)
        if self.backend == "torch":
            return reference_attention(self.reference, q, k_cache, v_cache)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.max_short_query:
            self._paged(q, k_cache, v_cache, out)
        for row in self.prefill_rows:
            if row.kv_slots is None and row.mask is None and self.backend == "cpp" and _prefill_kernel_takes(q, k, v):
                from worker import cpu_attention

                rows = slice(row.start, row.end)
                cpu_attention.prefill_attention(q[rows], k[rows], v[rows], q.shape[-1] ** -0.5, out[rows])
            else:
                out[row.start : row.end] = self._prefill(row, q, k, v, k_cache, v_cache)
        return out

    def _paged(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
        scale = q.shape[-1] ** -0.5
        if self.backend == "triton":
            from worker import triton_attention

            triton_attention.paged_attention(q, k_cache, v_cache, *self.paged_args, self.block_size, self.window,
                                             scale, out, self.max_short_query)
        else:
            from worker import cpu_attention

            cpu_attention.paged_attention(q, k_cache, v_cache, *self.paged_args, self.block_size, self.window,
                                          scale, out)

    @staticmethod
    def _prefill(row: PrefillRow, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> torch.Tensor:
        def heads(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [1, H, T, D]
            return x.transpose(0, 1).unsqueeze(0)

        queries, gqa = heads(q[row.start : row.end]), q.shape[1] != k.shape[1]
        if row.mask is not None:  # a sliding window (or a prefix off CPU): SDPA over the whole context
            keys, values = k_cache.index_select(0, row.kv_slots), v_cache.index_select(0, row.kv_slots)
            out = F.scaled_dot_product_attention(queries, heads(keys), heads(values), attn_mask=row.mask,
                                                 enable_gqa=gqa)
            return out[0].transpose(0, 1)
        own_k, own_v = heads(k[row.start : row.end]), heads(v[row.start : row.end])
        if row.kv_slots is None:
            out = F.scaled_dot_product_attention(queries, own_k, own_v, is_causal=True, enable_gqa=gqa)
            return out[0].transpose(0, 1)
        # A chunk after a cached prefix (chunked prefill, a prefix-cache hit): no [q, kv] mask to
        # build and no masked-out half to compute -- the prefix without a mask, the chunk's own
        # tokens causally (SDPA skips the blocks above the diagonal), merged exactly by log-sum-exp.
        # (The CPU flash kernel takes GQA shapes as they are.)
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out_own, lse_own = flash(queries, own_k, own_v, is_causal=True)[:2]
        out_pre, lse_pre = flash(queries, heads(k_cache.index_select(0, row.kv_slots)),
                                 heads(v_cache.index_select(0, row.kv_slots)))[:2]
        top = torch.maximum(lse_own, lse_pre)
        w_own, w_pre = torch.exp(lse_own - top).unsqueeze(-1), torch.exp(lse_pre - top).unsqueeze(-1)
        out = (out_own.float() * w_own + out_pre.float() * w_pre) / (w_own + w_pre)
        return out[0].transpose(0, 1).to(q.dtype)


def _prefill_kernel_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the C++ prefill kernel can attend these (fp32 on CPU, each token's heads contiguous);
    it is built at engine start, with the paged kernel (default_backend)."""
    from worker import cpu_attention

    dim = q.shape[-1]
    return (q.dtype == torch.float32 and q.device.type == "cpu" and cpu_attention.prefill_available()
            and all(t.stride(-1) == 1 and t.stride(-2) == dim for t in (q, k, v)))


class ReferenceLayout:
    """The torch reference's per-step tensors: every row's context gathered densely, a host-built mask."""

    def __init__(self, layout: StepLayout, block_size: int, device: torch.device, sliding_window: int | None,
                 dtype: torch.dtype) -> None:
        qsl, bt = layout.query_start_loc, layout.block_tables
        max_q, max_kv = int(layout.query_lens.max()), int(layout.seq_lens.max())
        j = np.arange(max_kv)
        kv_valid = j[None, :] < layout.seq_lens[:, None]
        blk = np.minimum(j // block_size, bt.shape[1] - 1)
        kv_gather = bt[:, blk].astype(np.int64) * block_size + (j % block_size)[None, :]
        kv_gather[~kv_valid] = 0
        i = np.arange(max_q)[None, :]
        # Query i of row r sits at absolute position num_computed[r] + i and sees keys j <= that.
        q_pos = layout.num_computed[:, None, None] + i[:, :, None]   # [B, max_q, 1]
        mask = (j[None, None, :] <= q_pos) & kv_valid[:, None, :]
        if sliding_window is not None:
            mask &= j[None, None, :] > q_pos - sliding_window
        # Rows of equal length (every decode step; verify steps with equal draft counts) need no
        # query padding: the flat tokens are already [B, max_q] row-major.
        self.max_q = max_q
        self.q_gather = self.q_valid = None
        if not (layout.query_lens == max_q).all():
            q_valid = i < layout.query_lens[:, None]
            q_gather = np.where(q_valid, qsl[:-1, None] + i, 0)
            mask |= ~q_valid[:, :, None] & (j[None, None, :] == 0)  # padding rows attend somewhere: no NaNs
            self.q_gather = torch.from_numpy(q_gather).to(device)
            self.q_valid = torch.from_numpy(q_valid).to(device)
        self.kv_shape = kv_gather.shape
        self.kv_gather = torch.from_numpy(kv_gather.reshape(-1)).to(device)
        # Additive float mask, built once per step (a bool mask is converted by every layer's SDPA call).
        self.mask = torch.from_numpy(np.where(mask, 0.0, -np.inf)).unsqueeze(1).to(device=device, dtype=dtype)


def reference_attention(ref: ReferenceLayout, q: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor) -> torch.Tensor:
    """Attention of every row over its gathered context (the cache already holds this step's K/V)."""
    b, max_kv = ref.kv_shape
    # index_select on the flat gather list is about twice as fast as advanced indexing.
    keys = k_cache.index_select(0, ref.kv_gather).view(b, max_kv, *k_cache.shape[1:]).transpose(1, 2)
    values = v_cache.index_select(0, ref.kv_gather).view(b, max_kv, *v_cache.shape[1:]).transpose(1, 2)
    queries = q.reshape(b, ref.max_q, *q.shape[1:]) if ref.q_gather is None else q[ref.q_gather]
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=ref.mask,
                                         enable_gqa=q.shape[1] != k_cache.shape[1]).transpose(1, 2)  # [B, max_q, H, D]
    return out.reshape(-1, *out.shape[2:]) if ref.q_valid is None else out[ref.q_valid]


# -- the compiled model's way in ------------------------------------------------------------

_local = threading.local()  # per thread: tests run a prefill and a decode engine as threads of one process


@contextlib.contextmanager
def forward_context(ctx: AttentionContext) -> Iterator[None]:
    """Make `ctx` the step's context for `pdserve::attention` calls (a compiled forward)."""
    previous, _local.ctx = getattr(_local, "ctx", None), ctx
    try:
        yield
    finally:
        _local.ctx = previous


@torch.library.custom_op("pdserve::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
    # It writes the KV cache, which is no graph input: the compiler only sees q, k, v -> out.
    ctx = getattr(_local, "ctx", None)
    assert ctx is not None, "pdserve::attention called outside forward_context"
    return ctx.attend(layer_idx, q, k, v)


@attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


class ForwardContextAttention:
    """The attention backend a compiled model is traced with: one opaque op per layer."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention_op(q, k, v, layer_idx)


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: str) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One tensor `[layers, 2, blocks, block_size, kv_heads, head_dim]` plus flat per-layer (k, v) views.

    Block `b` of layer `l` is `cache[l, :, b]`: the unit the KV transfer ships.
    """
    cache = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    views = [(cache[layer, 0].view(-1, num_kv_heads, head_dim), cache[layer, 1].view(-1, num_kv_heads, head_dim))
             for layer in range(num_layers)]
    return cache, views
