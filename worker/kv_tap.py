"""The KV tap: attention reports each layer's KV writes of tapped prompts (layer-wise KV push).

A prefill engine in PD hands the KV of a prompt's positions [0, prompt_len) to a decode
instance. To overlap that transfer with the prefill, attention calls the step's `LayerTap`
right after it wrote a layer's K/V (target layers in the model forward, MTP layers in the
drafter's pass over the chunk), and the tap hands the layer's KV of each tapped row's new
positions to the sink, as a host copy so that nothing downstream depends on the cache blocks.
On CUDA the copy runs on a side stream into pinned memory and an event says when it is done:
the compute stream never waits for it.

The first chunk of a request also reports the positions before it (a prefix-cache hit: never
computed here, but still part of the KV the decode instance needs).

With a windowed MTP drafter the prefill engine does not run the MTP layer at all: each chunk hands
the sink the target's hidden states of its positions among the prompt's last `window` (`hand_over_hidden`),
and the decode instance's drafter runs the layer over them when it first drafts.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from worker.input_batch import StepLayout

TapTarget = Callable[[str], int | None]   # req_id -> prompt length to report, None: not tapped
Snapshots = Callable[[str], bool]         # req_id -> whether its layers go to the sink (layer-wise push)
LayersDone = Callable[[str], None]        # req_id: the forward of the prompt's last KV layer is over
# (req_id, layer, start, end, kv [2, end - start, heads, dim] on the host, copy-done event or None)
LayerSink = Callable[[str, int, int, int, torch.Tensor, torch.cuda.Event | None], None]
HiddenSink = Callable[[str, int, torch.Tensor], None]  # (req_id, first position, hidden states [n, hidden])


@dataclass
class TapRow:
    req_id: str
    start: int   # first position to report (0 on a request's first chunk)
    end: int     # one past the last, at most the prompt's length
    last: bool   # the prompt's last chunk
    snapshot: bool  # hand each layer's KV of [start, end) to the sink
    prompt_len: int  # the positions handed over


class KVTap:
    def __init__(self, kv_cache: torch.Tensor, block_size: int, target: TapTarget, sink: LayerSink,
                 snapshot: Snapshots, layers_done: LayersDone, hidden_sink: HiddenSink | None = None) -> None:
        """`snapshot(req_id)`: hand the sink a host copy of each layer's KV of that request; else
        only report `layers_done`, which hears when the last KV layer's forward over a prompt's
        last chunk is over. `hidden_sink` takes the hidden states of `hand_over_hidden`."""
        self.kv_cache, self.block_size, self.target, self.sink = kv_cache, block_size, target, sink
        self.layers_done, self.hidden_sink = layers_done, hidden_sink
        self.snapshot = snapshot
        self.reported: dict[str, int] = {}   # req_id -> positions reported on every layer so far
        self.side_stream = torch.cuda.Stream(kv_cache.device) if kv_cache.device.type == "cuda" else None

    def forget(self, req_ids: Sequence[str]) -> None:
        """Finished or preempted: a recompute reports from position 0 again."""
        for req_id in req_ids:
            self.reported.pop(req_id, None)

    def step(self, req_ids: list[str], layout: StepLayout) -> StepTap | None:
        """What this step reports: per tapped row, its chunk's prompt positions."""
        rows: dict[str, TapRow] = {}
        for r, req_id in enumerate(req_ids):
            prompt_len = self.target(req_id)
            if prompt_len is None:
                continue
            start = int(layout.num_computed[r])
            end = min(start + int(layout.query_lens[r]), prompt_len)
            if end <= start:
                continue
            rows[req_id] = TapRow(req_id, min(self.reported.get(req_id, 0), start), end, end == prompt_len,
                                  self.snapshot(req_id), prompt_len)
            self.reported[req_id] = end
        return StepTap(self, rows) if rows else None


class StepTap:
    """One step's tapped rows; `layer_tap` binds them to a pass's layout (target or MTP)."""

    def __init__(self, tap: KVTap, rows: dict[str, TapRow]) -> None:
        self.tap, self.rows = tap, rows

    def hand_over_hidden(self, req_ids: Sequence[str], layout: StepLayout, hidden: torch.Tensor, window: int) -> None:
        """Hand the sink each tapped row's hidden states (`hidden`: the step's, row by row as in
        `layout`) of the positions among its prompt's last `window` that this step computed."""
        sink = self.tap.hidden_sink
        if sink is None:
            return
        for r, req_id in enumerate(req_ids):
            row = self.rows.get(req_id)
            if row is None:
                continue
            computed = int(layout.num_computed[r])
            first = max(computed, row.prompt_len - window)
            if first < row.end:
                at = int(layout.query_start_loc[r]) + first - computed
                sink(req_id, first, hidden[at : at + row.end - first])

    def tapped(self, req_ids: Sequence[str]) -> np.ndarray:
        """Per row of the step, whether it has prompt positions to report."""
        return np.array([r in self.rows for r in req_ids], dtype=bool)

    def last_layer_done(self) -> None:
        """The pass that writes the last KV layer (the model forward, or the MTP pass) is over."""
        for row in self.rows.values():
            if row.last:
                self.tap.layers_done(row.req_id)

    def layer_tap(self, req_ids: Sequence[str], layout: StepLayout) -> LayerTap | None:
        bs, device = self.tap.block_size, self.tap.kv_cache.device
        picked = []
        for r, req_id in enumerate(req_ids):
            row = self.rows.get(req_id)
            if row is None or not row.snapshot:
                continue
            pos = np.arange(row.start, row.end)
            slots = layout.block_tables[r, pos // bs].astype(np.int64) * bs + pos % bs
            picked.append((row, torch.from_numpy(slots).to(device)))
        return LayerTap(self.tap, picked) if picked else None


class LayerTap:
    """Called by attention after it wrote layer `layer`'s K/V of the step."""

    def __init__(self, tap: KVTap, rows: list[tuple[TapRow, torch.Tensor]]) -> None:
        self.tap, self.rows = tap, rows

    def __call__(self, layer: int) -> None:
        tap = self.tap
        for row, slots in self.rows:
            layer_kv = tap.kv_cache[layer]  # [2, blocks, block_size, heads, dim]
            kv, ready = self._to_host(layer_kv.view(2, -1, *layer_kv.shape[3:]).index_select(1, slots))
            tap.sink(row.req_id, layer, row.start, row.end, kv, ready)

    def _to_host(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        stream = self.tap.side_stream
        if stream is None:
            return kv, None  # index_select made a copy already
        host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(kv.device))
        with torch.cuda.stream(stream):
            host.copy_(kv, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        kv.record_stream(stream)  # the allocator must not reuse kv's memory before the copy ran
        return host, ready
