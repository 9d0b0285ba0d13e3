"""Building blocks of the Llama family's decoder (Llama, Mistral, Qwen2, Qwen3) and of the MTP layer.

Module and parameter names mirror Hugging Face's so checkpoint keys load one to one.
Tokens arrive flattened (`[T, hidden]`, all requests of the step back to back); attention
is delegated to the per-step attention backend, so this file never sees paging.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import torch
from torch import nn

from engine.config import ModelConfig
from worker import fused_ops
from worker.models.linear import GateUpLinear, Linear


class AttentionBackend(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class KVWriter(Protocol):
    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.hf_exact = True  # False for the drafter: proposals need no bit-exactness, only speed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.hf_exact or (x.dtype == torch.float32 and self.weight.dtype == torch.float32):
            # One op (worker/fused_ops.py); in fp32 it matches the expanded form below.
            return fused_ops.rms_norm(x, self.weight, self.eps)
        # Normalise in fp32 and cast back before the weight, exactly as transformers does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, self(x + residual)): the residual add before this norm, one op where fused."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)
        total = x + residual
        return total, self(total)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies for default, linear and llama3 RoPE scaling (as transformers computes them)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * rope_inv_freq(cfg)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        # [max_positions, 2, 1, head_dim]: cos and sin side by side, so one lookup fetches both.
        self.register_buffer("cos_sin", torch.stack([emb.cos(), emb.sin()], dim=1).unsqueeze(2), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos/sin rows for this forward's positions, looked up once and shared by every layer."""
        cos, sin = self.cos_sin[positions].to(dtype).unbind(1)
        return Rope(cos, sin)


class Rope(NamedTuple):
    cos: torch.Tensor  # [T, 1, head_dim]
    sin: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; the same arithmetic as transformers' apply_rotary_pos_emb."""
        return fused_ops.rope(x, self.cos, self.sin)

    def apply_qk_norm(self, x: torch.Tensor, num_q: int, q_norm: RMSNorm, k_norm: RMSNorm) -> torch.Tensor:
        """apply(cat(q_norm(x[:, :num_q]), k_norm(x[:, num_q:]))) in fp32, one op where fused."""
        return fused_ops.qk_norm_rope(x, num_q, q_norm.weight, k_norm.weight, q_norm.eps, self.cos, self.sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        o_bias = cfg.attention_bias and cfg.model_type != "qwen2"  # Qwen2: biases on q/k/v only
        self.qkv_proj = Linear(h, q_rows + 2 * kv_rows, bias=cfg.attention_bias,
                               shards={"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows})
        self.o_proj = Linear(q_rows, h, bias=o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, rope: Rope, attn: AttentionBackend) -> torch.Tensor:
        t, nh, nkv = x.shape[0], self.num_heads, self.num_kv_heads
        heads = self.qkv_proj(x).view(t, nh + 2 * nkv, self.head_dim)
        v = heads[:, nh + nkv :]
        if self.qk_norm and not (x.dtype == self.q_norm.weight.dtype == torch.float32):  # transformers' bf16 norms
            q, k = rope.apply(self.q_norm(heads[:, :nh])), rope.apply(self.k_norm(heads[:, nh : nh + nkv]))
        else:  # q and k normed (Qwen3) and rotated together: one op instead of two or four
            qk = heads[:, : nh + nkv]
            qk = rope.apply_qk_norm(qk, nh, self.q_norm, self.k_norm) if self.qk_norm else rope.apply(qk)
            q, k = qk[:, :nh], qk[:, nh:]
        out = attn.attend(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(t, nh * self.head_dim))

    def write_kv(self, x: torch.Tensor, rope: Rope, cache: KVWriter) -> None:
        """Only this layer's K/V of x's positions into the cache: no query, no attention."""
        t, nh, nkv = x.shape[0], self.num_heads, self.num_kv_heads
        heads = self.qkv_proj(x).view(t, nh + 2 * nkv, self.head_dim)
        k = heads[:, nh : nh + nkv]
        cache.write(self.layer_idx, rope.apply(self.k_norm(k) if self.qk_norm else k), heads[:, nh + nkv :])


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        bias = bool(cfg.raw.get("mlp_bias", False))
        n = cfg.intermediate_size
        self.gate_up_proj = GateUpLinear(cfg.hidden_size, n, bias=bias)
        self.down_proj = Linear(n, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the residual stream `residual + x` (x alone for the first layer): returns
        the MLP's output and the stream before it, which the next layer's norm (or the caller) adds
        up. Each add is so fused with the norm after it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_forward(x, residual)
        residual, h = self.post_attention_layernorm.add_forward(self.self_attn(h, rope, attn), residual)
        return self.mlp(h), residual
