"""The target model's forward, compiled with torch.compile (Inductor) or run eagerly.

Compiled as vLLM compiles its models: dynamic shapes (the token count of a step is symbolic),
attention left opaque (`pdserve::attention`, which finds the step's context through
`forward_context`), so a server that sees every batch size and prompt length compiles a bounded
number of graphs: Dynamo specialises a size of 1, so there are two, one for single-token steps
and one for the rest. Each compile (a recompile too) is logged. Inductor's on-disk caches (FX graph and AOT
autograd, under `TORCHINDUCTOR_CACHE_DIR`) make a restart load the compiled code instead of
compiling again.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch._dynamo.utils import counters

from worker.attention import AttentionContext, ForwardContextAttention, forward_context
from worker.input_batch import StepLayout
from worker.models.llama import CausalLM

logger = logging.getLogger(__name__)

# A persistent home for Inductor's caches (its default is under /tmp, which hosts clean).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "pdserve" / "inductor"))
# Each runner's forward is the same code object guarded on its own model, so several engines in
# one process (tests, the offline API) each add an entry; the default limit of 8 would silently
# send the ninth back to eager.
torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)


class ModelForward:
    """`hidden = forward(input_ids, positions, ctx)`: the target model's final hidden states."""

    def __init__(self, model: CausalLM, compile_model: bool) -> None:
        self.model = model
        self.compiled = None
        self.num_graphs = 0
        if compile_model:
            backend = ForwardContextAttention()

            def traced(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
                return model(input_ids, positions, backend)

            self.compiled = torch.compile(traced, dynamic=True, fullgraph=True)

    def warm_up(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, max_blocks: int,
                device: torch.device) -> None:
        """Compile both graphs now, before the engine serves: a compile inside a step would stall
        the loop for seconds (and the front end would take the silent engine for dead). The dummy
        steps write into block 0, which no request holds yet."""
        if self.compiled is None:
            return
        table = np.zeros((1, max_blocks), dtype=np.int32)
        for computed, new in ((0, 2), (2, 1)):
            layout = StepLayout(table, np.array([computed], np.int32), np.array([new], np.int32))
            ctx = AttentionContext(kv_caches, layout, block_size, device)
            self(torch.zeros(new, dtype=torch.int32, device=device), ctx.positions, ctx)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        if self.compiled is None:
            return self.model(input_ids, positions, ctx)
        start, before = time.monotonic(), counters["stats"]["unique_graphs"]
        with forward_context(ctx):
            hidden = self.compiled(input_ids, positions)
        new_graphs = counters["stats"]["unique_graphs"] - before  # Dynamo's count, for the whole process
        if new_graphs:  # this call compiled a graph (or loaded it from the cache)
            self.num_graphs += new_graphs
            logger.info("compiled the model forward for %d tokens in %.1f s (%d graphs so far)",
                        input_ids.shape[0], time.monotonic() - start, self.num_graphs)
        return hidden
