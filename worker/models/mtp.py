"""MiMo-style multi-token-prediction (MTP) layer (docs/architecture.md, speculative decoding).

At position i the layer sees the target's final hidden state h_i (after `model.norm`) and the
embedding of the next token x_{i+1}; it predicts x_{i+2} through the shared lm_head. Its output
(after `final_layernorm`) plays the role of h for the next recursive draft. It keeps its own
paged KV cache (its attention layer index follows the target's layers).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from engine.config import ModelConfig
from worker.attention import AttentionContext, CacheWriter
from worker.models.layers import AttentionBackend, DecoderLayer, RMSNorm, RotaryEmbedding
from worker.models.linear import BF16_MAX_ROWS, Linear, gemm_weight


class FusedWeights(NamedTuple):
    norms: list[torch.Tensor]          # hidden, token, input, post-attention, final[, q, k] norms (fp32)
    weights: list[torch.Tensor]        # input_proj, qkv, o, gate_up, down (bf16)
    gemm_weights: list[torch.Tensor]   # the same for inputs of more than BF16_MAX_ROWS rows (see gemm_weight)
    biases: list[torch.Tensor | None]
    num_heads: int
    eps: float


class MTPLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, kv_layer_idx: int) -> None:
        super().__init__(cfg, kv_layer_idx)
        h = cfg.hidden_size
        self.hidden_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.token_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.input_proj = Linear(2 * h, h, bias=False)
        self.final_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.fused: FusedWeights | None = None  # set by fuse()

    def fuse(self) -> None:
        """Run as one C++ op (`mtp_layer`, worker/csrc/bf16_linear.cpp) where a step allows it: on a
        CPU, for a float32 target whose drafter keeps bf16 weights with fp32 arithmetic (every
        Linear here has `keep_bf16` and its plain fp32 weight), and the C++ paged-attention kernel.
        The ~40 torch ops of the layer cost more in dispatch than in arithmetic at a few rows."""
        attn, mlp = self.self_attn, self.mlp
        linears = [self.input_proj, attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        norms = [self.hidden_layernorm, self.token_layernorm, self.input_layernorm, self.post_attention_layernorm,
                 self.final_layernorm] + ([attn.q_norm, attn.k_norm] if attn.qk_norm else [])
        self.fused = FusedWeights([n.weight.detach().float().contiguous() for n in norms],
                                  [lin.bf16 for lin in linears], [gemm_weight(lin) for lin in linears],
                                  [lin.bias for lin in linears], attn.num_heads, self.input_layernorm.eps)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                embed: nn.Embedding, rope: RotaryEmbedding, attn: AttentionBackend,
                has_position0: bool) -> torch.Tensor:
        # Steps whose rows are all short (decode, verify, drafts: the paged kernel's) run fused;
        # prefill chunks, which attend with SDPA, and compute more than they dispatch, do not.
        if self.fused is not None and hidden.dtype == torch.float32:
            paged = attn.paged_inputs(self.self_attn.layer_idx) if isinstance(attn, AttentionContext) else None
            if paged is not None:
                f = self.fused
                out = torch.ops.pdserve_bf16.mtp_layer(
                    hidden.contiguous(), input_ids.to(torch.int32), positions, embed.weight, rope.cos_sin, f.norms,
                    f.weights, f.gemm_weights, f.biases, *paged, f.num_heads, f.eps, has_position0, BF16_MAX_ROWS)
                if attn.tap is not None:
                    attn.tap(self.self_attn.layer_idx)
                return out
        x = self._pair(hidden, input_ids, positions, embed, has_position0)
        x, residual = super().forward(x, None, rope(positions, x.dtype), attn)
        return self.final_layernorm.add_forward(x, residual)[1]

    def write_kv(self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                 embed: nn.Embedding, rope: RotaryEmbedding, cache: CacheWriter, has_position0: bool) -> None:
        """Only the layer's K/V of these positions: what later drafts attend. For positions no draft
        starts from (a prompt's, a backfilled stash's) the query, attention and MLP are wasted work."""
        x = self.input_layernorm(self._pair(hidden, input_ids, positions, embed, has_position0))
        self.self_attn.write_kv(x, rope(positions, x.dtype), cache)

    def _pair(self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, embed: nn.Embedding,
              has_position0: bool) -> torch.Tensor:
        """The layer's input: h_i and the embedding of x_{i+1}, normed and projected together."""
        dtype = self.input_proj.weight.dtype  # the drafter may run in lower precision than the target
        tok, hidden = embed(input_ids).to(dtype), hidden.to(dtype)
        if has_position0:  # (the caller knows from its host-side layout; decode steps never do)
            # Position 0 has no previous hidden state worth pairing: its token embedding is zeroed.
            tok = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(tok), tok)
        return self.input_proj(torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(tok)], dim=-1))
