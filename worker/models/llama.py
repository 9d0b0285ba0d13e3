"""Decoder-only transformer of the Llama family (Llama, Mistral, Qwen2, Qwen3), with optional MTP layers.

Module and parameter names mirror Hugging Face's so checkpoint keys load one to one; the layers
themselves are in `worker/models/layers.py`.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from worker.attention import CacheWriter
from worker.models.layers import AttentionBackend, DecoderLayer, RMSNorm, RotaryEmbedding
from worker.models.linear import BF16_MAX_ROWS, Linear, gemm_weight
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
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x, residual = layer(x, residual, rope, attn)
        return self.norm.add_forward(x, residual)[1]


class CausalLM(nn.Module):
    """Target model: `forward` returns final (normed) hidden states; `compute_logits` applies lm_head."""

    def __init__(self, cfg: ModelConfig, max_positions: int, num_mtp_layers: int = 0) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_positions, num_mtp_layers)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.draft_head: Linear | None = None  # set by set_draft_dtype / set_draft_vocab
        self.draft_vocab: torch.Tensor | None = None  # the ids draft_head scores, when not the whole vocab
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

    def draft_linears(self) -> list[Linear]:
        """The linears a draft runs besides lm_head: the MTP layers' and the draft head, if any."""
        heads = [self.draft_head] if self.draft_head is not None else []
        return [m for m in self.model.mtp_layers.modules() if isinstance(m, Linear)] + heads

    def set_bf16_draft_head(self, weight: torch.Tensor) -> None:
        """A draft head that is lm_head (its fp32 weight, or packed copy, for big inputs) plus a
        bf16 copy of `weight` for few rows (Linear.keep_bf16). Made after packing, so that it
        shares lm_head's packed weight instead of packing one of its own."""
        with torch.device("meta"):
            head = Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        head.share_weights(self.lm_head)
        head.keep_bf16(weight)
        self.draft_head = head

    def set_draft_vocab(self, token_ids: list[int]) -> None:
        """Draft over these tokens only (FR-Spec's frequency-ranked draft vocabulary): the draft
        head keeps just their rows of lm_head, and every other token gets a draft logit of -inf.
        On a small model the vocab-sized lm_head is a large share of an MTP draft's cost. Exactness
        does not depend on it: the masked logits are a proper draft distribution (greedy drafts are
        its argmax, sampled ones are drawn from it and handed to the rejection sampler as such)."""
        unique = sorted(set(token_ids))
        if not unique or unique[0] < 0 or unique[-1] >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary: {len(unique)} token ids, which must lie in "
                             f"[0, {self.config.vocab_size}); got {unique[:1]}..{unique[-1:]}")
        ids = torch.tensor(unique, dtype=torch.long, device=self.lm_head.weight.device)
        full = (self.draft_head or self.lm_head).weight.detach()
        with torch.device("meta"):
            self.draft_head = Linear(self.config.hidden_size, len(ids), bias=False)
        self.draft_head.weight = nn.Parameter(full.index_select(0, ids).contiguous(), requires_grad=False)
        self.draft_vocab = ids

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for proposing drafts from an MTP hidden state (in the drafter's precision)."""
        logits = self.draft_head_logits(hidden)
        if self.draft_vocab is None:
            return logits
        full = torch.full((hidden.shape[0], self.config.vocab_size), float("-inf"), device=hidden.device)
        return full.index_copy_(1, self.draft_vocab, logits)

    def draft_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft head's fp32 logits over the draft vocabulary (the whole one without a draft
        vocabulary): what worker/sample/draft.py takes the greedy drafts' argmax of."""
        return (self.draft_head or self.lm_head)(hidden).float()

    def fused_drafts(self, hidden: torch.Tensor, last_pos: torch.Tensor, k: int, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, block_table: torch.Tensor, block_size: int, window: int | None,
                     pass_ids: torch.Tensor | None = None, pass_len: torch.Tensor | None = None,
                     noise: torch.Tensor | None = None, inv_temp: torch.Tensor | None = None,
                     draft_probs: torch.Tensor | None = None) -> torch.Tensor | None:
        """k drafts per row [rows, k] (int32) as one C++ op (mtp_draft): draft 0 from the MTP hidden
        states `hidden` at positions `last_pos`, each next one from the layer run once more; what
        `sample.draft.greedy_draft_tokens` (or, with `noise`, the coupled draw of `pick_draft_tokens`) and
        `mtp_forward` compute draft by draft. With `pass_ids`, `hidden` holds the target's hidden
        states of each row's `pass_len` positions up to `last_pos`, which the MTP layer first runs
        over (x_{i+1} = pass_ids). `noise` [rows, k, vocab]: the uniforms the verifier samples each
        draft's output position with, `inv_temp` [rows]: 1 / temperature. With `draft_probs`
        [rows, k, draft vocab] the drafts are drawn independently instead, from q = softmax(logits *
        inv_temp) over the draft vocabulary by inverse CDF with `noise` [rows, k, 1] (one uniform a
        draft), and q is written there (for the rejection sampler). None where the fused MTP layer or
        the draft head's bf16 weight is not there."""
        layer, head = self.model.mtp_layers[0], self.draft_head
        if layer.fused is None or head is None or head.bf16 is None:
            return None
        f, ints, floats = layer.fused, torch.empty(0, dtype=torch.int32), torch.empty(0)
        vocab = self.draft_vocab if self.draft_vocab is not None else torch.empty(0, dtype=torch.long)
        return torch.ops.pdserve_bf16.mtp_draft(
            hidden.contiguous(), ints if pass_ids is None else pass_ids, ints if pass_len is None else pass_len,
            last_pos, k, head.bf16, gemm_weight(head), vocab, floats if noise is None else noise,
            floats if inv_temp is None else inv_temp, floats if draft_probs is None else draft_probs,
            self.model.embed_tokens.weight, self.model.rotary_emb.cos_sin,
            f.norms, f.weights, f.gemm_weights, f.biases, k_cache, v_cache, block_table, block_size, window or 0,
            f.num_heads, f.eps, BF16_MAX_ROWS)

    def warm_up_draft_gemms(self, max_rows: int) -> None:
        """Have oneDNN make its bf16 GEMM for each input of BF16_MAX_ROWS < M <= max_rows rows, for every
        weight the fused MTP ops multiply such inputs by (gemm_weight). It makes one per shape on first use,
        a slow call; left to the first drafting steps at a batch size, those would land in the speculation
        policy's first timings there, make drafting look far costlier than it is in steady state, and keep
        the policy from drafting at that batch size again."""
        layer, head = self.model.mtp_layers[0], self.draft_head
        if layer.fused is None or head is None or head.bf16 is None:
            return
        for weight in [*layer.fused.gemm_weights, gemm_weight(head)]:
            if weight.dtype == torch.bfloat16:  # (an fp32 GEMM makes nothing per shape)
                for rows in range(BF16_MAX_ROWS + 1, max_rows + 1):
                    nn.functional.linear(torch.zeros(rows, weight.shape[1], dtype=torch.bfloat16), weight)

    def mtp_forward(self, layer: int, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                    attn: AttentionBackend, has_position0: bool = True) -> torch.Tensor:
        """MTP layer `layer` over (h_i, x_{i+1}) pairs; returns its normed hidden states."""
        m = self.model
        return m.mtp_layers[layer](hidden, input_ids, positions, m.embed_tokens, m.rotary_emb, attn, has_position0)

    def mtp_write_kv(self, layer: int, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                     cache: CacheWriter, has_position0: bool = True) -> None:
        """Only MTP layer `layer`'s K/V of these (h_i, x_{i+1}) pairs (MTPLayer.write_kv)."""
        m = self.model
        m.mtp_layers[layer].write_kv(hidden, input_ids, positions, m.embed_tokens, m.rotary_emb, cache, has_position0)
