"""Decoder-only transformer of the Llama family (Llama, Mistral, Qwen2, Qwen3), with optional MTP layers.

Module and parameter names mirror Hugging Face's so checkpoint keys load one to one; the layers
themselves are in `worker/models/layers.py`.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from worker.models.layers import AttentionBackend, DecoderLayer, RMSNorm, RotaryEmbedding
from worker.models.linear import Linear
from worker.models.mtp import MTPLayer


class DecoderModel(nn.Module):
    """`model.*` of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig, max_positions: int, num_mtp_layers: int = 0) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg, max_positions)
        # MTP layers own the KV-cache layer indices right after the target's.
        self.mtp_layers = nn.ModuleList(MTPLayer(cfg, cfg.num_hidden_layers + i) for i in range(num_mtp_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, attn)
        return self.norm(x)


class CausalLM(nn.Module):
    """Target model: `forward` returns final (normed) hidden states; `compute_logits` applies lm_head."""

    def __init__(self, cfg: ModelConfig, max_positions: int, num_mtp_layers: int = 0) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_positions, num_mtp_layers)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.draft_head: Linear | None = None  # set by set_draft_dtype
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def set_draft_dtype(self, dtype: torch.dtype) -> None:
        """Run the MTP layers and a copy of lm_head for drafting in `dtype` (after loading)."""
        self.model.mtp_layers.to(dtype)
        for module in self.model.mtp_layers.modules():
            if isinstance(module, RMSNorm):
                module.hf_exact = False
        with torch.device("meta"):  # no throwaway initialisation of a vocab-sized weight
            self.draft_head = Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        self.draft_head.weight = nn.Parameter(self.lm_head.weight.detach().to(dtype), requires_grad=False)

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for proposing drafts from an MTP hidden state (in the drafter's precision)."""
        return (self.draft_head or self.lm_head)(hidden).float()

    def mtp_forward(self, layer: int, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                    attn: AttentionBackend, has_position0: bool = True) -> torch.Tensor:
        """MTP layer `layer` over (h_i, x_{i+1}) pairs; returns its normed hidden states."""
        m = self.model
        return m.mtp_layers[layer](hidden, input_ids, positions, m.embed_tokens, m.rotary_emb, attn, has_position0)
