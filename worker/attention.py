"""Paged attention in torch, driven by a per-step context.

The runner builds one `AttentionContext` per step (slot mapping, gather indices, mask); every
layer then writes its new K/V into the paged cache and attends over the gathered blocks. The
model only calls `ctx.attend(layer, q, k, v)` and never sees block tables.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class StepLayout:
    """Host-side description of one step's batch (all arrays indexed by batch row)."""

    block_tables: np.ndarray     # [B, max_blocks] int32, physical block ids of each row
    num_computed: np.ndarray     # [B] tokens already in the cache before this step
    query_lens: np.ndarray       # [B] tokens computed this step

    def __post_init__(self) -> None:
        self.query_start_loc = np.zeros(len(self.query_lens) + 1, dtype=np.int32)
        np.cumsum(self.query_lens, out=self.query_start_loc[1:])
        self.seq_lens = self.num_computed + self.query_lens
        if int(self.query_lens.max()) == 1:  # all single-token rows (decode): one position each
            self._positions = self.num_computed.astype(np.int64)
        else:
            row = np.repeat(np.arange(len(self.query_lens)), self.query_lens)
            self._positions = (self.num_computed[row] + (np.arange(int(self.query_start_loc[-1]))
                                                         - self.query_start_loc[:-1][row])).astype(np.int64)

    def positions(self) -> np.ndarray:
        return self._positions


class AttentionContext:
    """Everything attention needs for one step, computed once and shared by all layers."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layout: StepLayout, block_size: int,
                 device: torch.device, sliding_window: int | None = None) -> None:
        self.kv_caches = kv_caches
        b = len(layout.query_lens)
        qsl = layout.query_start_loc
        positions = layout.positions()
        bt = layout.block_tables
        max_q, max_kv = int(layout.query_lens.max()), int(layout.seq_lens.max())
        row = np.repeat(np.arange(b), layout.query_lens)
        slot_mapping = bt[row, positions // block_size].astype(np.int64) * block_size + positions % block_size

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

        self.positions = torch.from_numpy(positions).to(device)
        self.slot_mapping = torch.from_numpy(slot_mapping).to(device)
        self.kv_shape = kv_gather.shape
        self.kv_gather = torch.from_numpy(kv_gather.reshape(-1)).to(device)
        # Additive float mask, built once per step (a bool mask is converted by every layer's SDPA call).
        dtype = kv_caches[0][0].dtype
        self.mask = torch.from_numpy(np.where(mask, 0.0, -np.inf)).unsqueeze(1).to(device=device, dtype=dtype)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for this step's tokens. Returns [T, H, D]."""
        k_cache, v_cache = self.kv_caches[layer_idx]
        if q.dtype != k_cache.dtype:  # a lower-precision MTP drafter: attend in the cache's dtype
            return self.attend(layer_idx, q.to(k_cache.dtype), k.to(k_cache.dtype), v.to(k_cache.dtype)).to(q.dtype)
        k_cache.index_copy_(0, self.slot_mapping, k)
        v_cache.index_copy_(0, self.slot_mapping, v)
        b, max_kv = self.kv_shape
        # index_select on the flat gather list is about twice as fast as advanced indexing.
        keys = k_cache.index_select(0, self.kv_gather).view(b, max_kv, *k_cache.shape[1:]).transpose(1, 2)
        values = v_cache.index_select(0, self.kv_gather).view(b, max_kv, *v_cache.shape[1:]).transpose(1, 2)  # [B, Hkv, max_kv, D]
        if self.q_gather is None:
            queries = q.reshape(b, self.max_q, *q.shape[1:])
        else:
            queries = q[self.q_gather]
        out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=self.mask,
                                             enable_gqa=q.shape[1] != k.shape[1]).transpose(1, 2)  # [B, max_q, H, D]
        return out.reshape(-1, *out.shape[2:]) if self.q_valid is None else out[self.q_valid]


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: str) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One tensor `[layers, 2, blocks, block_size, kv_heads, head_dim]` plus flat per-layer (k, v) views.

    Block `b` of layer `l` is `cache[l, :, b]`: the unit the KV transfer ships.
    """
    cache = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    views = [(cache[l, 0].view(-1, num_kv_heads, head_dim), cache[l, 1].view(-1, num_kv_heads, head_dim))
             for l in range(num_layers)]
    return cache, views
