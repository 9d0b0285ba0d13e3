"""MiMo-style multi-token-prediction (MTP) layer (DESIGN.md §4).

At position i the layer sees the target's final hidden state h_i (after `model.norm`) and the
embedding of the next token x_{i+1}; it predicts x_{i+2} through the shared lm_head. Its output
(after `final_layernorm`) plays the role of h for the next recursive draft. It keeps its own
paged KV cache (its attention layer index follows the target's layers).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from worker.models.layers import AttentionBackend, DecoderLayer, RMSNorm, RotaryEmbedding
from worker.models.linear import Linear


class MTPLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, kv_layer_idx: int) -> None:
        super().__init__(cfg, kv_layer_idx)
        h = cfg.hidden_size
        self.hidden_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.token_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.input_proj = Linear(2 * h, h, bias=False)
        self.final_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                embed: nn.Embedding, rope: RotaryEmbedding, attn: AttentionBackend,
                has_position0: bool) -> torch.Tensor:
        dtype = self.input_proj.weight.dtype  # the drafter may run in lower precision than the target
        tok, hidden = embed(input_ids).to(dtype), hidden.to(dtype)
        if has_position0:  # (the caller knows from its host-side layout; decode steps never do)
            # Position 0 has no previous hidden state worth pairing: its token embedding is zeroed.
            tok = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(tok), tok)
        x = self.input_proj(torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(tok)], dim=-1))
        x = super().forward(x, rope(positions, x.dtype), attn)
        return self.final_layernorm(x)
