"""Linear layers for inference: stacked projections and, on CPU, oneDNN pre-packed weights.

Two things make small-batch decode cheap on a CPU, where every step is a handful of rows:

- Stacking: q/k/v are one GEMM (`qkv_proj`) and gate/up another (`gate_up_proj`), as in vLLM.
  The checkpoint keeps them apart; `Linear.shards` names the checkpoint tensors that fill each
  row range, and the loader copies each one into its slice.
- Packing: `F.linear` goes through MKL, which on this class of CPU runs a 3-row input as three
  GEMVs (3x the cost of one row). oneDNN with a weight reordered once at load time handles
  1..16 rows for little more than one, which is what a speculative verify step (1 + K rows per
  request) needs. Weights are packed on CPU for fp32, and for bf16 where the CPU has native bf16
  math (a bf16 MTP drafter); elsewhere `F.linear` runs.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """`nn.Linear` whose rows may be stacked from several checkpoint tensors and whose weight may be packed."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shards: dict[str, int] | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        # Checkpoint tensor name (sibling of this module) -> number of rows, in stacking order.
        self.shards = shards
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def pack(self, keep_weight: bool) -> None:
        """Reorder the weight for oneDNN. Without `keep_weight` the plain copy is freed (the packed
        one is then the only one); a weight shared with the embedding must be kept."""
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        if not keep_weight:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)


@functools.cache
def native_bf16_cpu() -> bool:
    """The CPU does bf16 math in hardware (AVX512-BF16 or AMX), so oneDNN bf16 GEMMs are fast."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return ("avx512_bf16" in flags or "amx_bf16" in flags) and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_pack(dtype: torch.dtype, device: str) -> bool:
    if device != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16_cpu())


def pack_linears(model: nn.Module, device: str, shared: set[int], skip: nn.Module | None = None) -> None:
    """Pack every `Linear` of `model` whose dtype oneDNN handles well here; weights whose id is in
    `shared` (tied embeddings) are kept. Linears inside `skip` (a part torch.compile will compile,
    which cannot trace a packed weight) stay plain."""
    unpacked = {id(m) for m in skip.modules()} if skip is not None else set()
    for module in model.modules():
        if isinstance(module, Linear) and id(module) not in unpacked and can_pack(module.weight.dtype, device):
            module.pack(keep_weight=id(module.weight) in shared)


def checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint key -> the tensor (or row slice of a stacked weight) it loads into.

    Keys follow Hugging Face naming: a stacked `...self_attn.qkv_proj.weight` appears as
    `...self_attn.q_proj.weight`, `...k_proj.weight` and `...v_proj.weight` row slices.
    """
    stacked = {name: m for name, m in model.named_modules() if isinstance(m, Linear) and m.shards}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        owner, _, leaf = name.rpartition(".")
        module = stacked.get(owner)
        if module is None:
            out[name] = tensor
            continue
        parent = owner.rpartition(".")[0]
        start = 0
        for shard, rows in module.shards.items():
            out[f"{parent}.{shard}.{leaf}" if parent else f"{shard}.{leaf}"] = tensor.data[start : start + rows]
            start += rows
    return out
