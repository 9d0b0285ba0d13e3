"""Linear layers for inference: stacked projections and, on CPU, oneDNN pre-packed weights.

Two things make small-batch decode cheap on a CPU, where every step is a handful of rows:

- Stacking: q/k/v are one GEMM (`qkv_proj`) and gate/up another (`gate_up_proj`), as in vLLM.
  The checkpoint keeps them apart; `Linear.shards` names the checkpoint tensors that fill each
  row range, and the loader copies each one into its slice.
- Packing: oneDNN with a weight reordered once at load time. Which of it and `F.linear` (MKL)
  is faster depends on the CPU and the row count: on an AMD EPYC MKL ran a few-row input as one
  GEMV per row (its cost growing with each row) where oneDNN handled up to 16 rows for little more
  than one; on a Xeon with AMX, fp32 MKL was faster for one row of a small projection and oneDNN won
  only from about 16 rows (from far fewer for the wide lm_head). So weights are packed on CPU for fp32,
  and for bf16 where the CPU has native bf16 math (a bf16 MTP drafter), and `tune_linears` then
  measures, per weight shape, from which row count the packed weight runs (below: `F.linear`),
  once per machine: the choice is kept for the engines that start later.
- bf16 weights (`keep_bf16`), for the MTP drafter of a float32 target on a CPU: inputs of at most
  BF16_MAX_ROWS rows are multiplied by a bfloat16 copy of the weight in fp32 arithmetic
  (`worker/csrc/bf16_linear.cpp`). A few rows' step reads every weight from memory, and half the
  bytes made the bundled model's projections faster for a few rows, where oneDNN's bf16 GEMM was
  slower than fp32 even with native bf16 math (benchmarks/results/bf16_linear.txt).
- Narrow weights of the target (`--dtype bfloat16` on a CPU, `--quantization int8`): the weight
  itself is stored in bf16 (`store_bf16`) or as int8 with one fp32 scale per output feature
  (`quantize_int8`), and the arithmetic stays fp32: a few rows go through a kernel that converts each
  weight as it reads it (worker/csrc/skinny_linear.h), inputs of more than NARROW_MAX_ROWS rows
  (prefill chunks) through oneDNN's GEMM, the weight dequantized a cache-sized block at a time
  (`linear_widening`).
  Such linears are never packed nor tuned: oneDNN would do bf16 math where the CPU has it, and the
  tuning record keeps fp32 shapes only.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine import settings
from worker import cpp_build, fused_ops

logger = logging.getLogger(__name__)


class Linear(nn.Linear):
    """`nn.Linear` whose rows may be stacked from several checkpoint tensors and whose weight may be packed."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shards: dict[str, int] | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        # Checkpoint tensor name (sibling of this module) -> number of rows, in stacking order.
        self.shards = shards
        # oneDNN-reordered weight (pack); a GateUpLinear's is its gate and up halves, packed apart.
        self.packed: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None
        self.packed_from = 0  # inputs of at least this many rows use `packed` (set by tune_linears)
        self.kernel_to = 0  # fp32: inputs of at most this many rows use our kernel (set by tune_linears)
        self.panels: torch.Tensor | None = None  # the fp32 weight as our kernel reads it (pack_panels)
        self.bf16: torch.Tensor | None = None  # set by keep_bf16 (and store_bf16)
        self.bf16_max_rows = BF16_MAX_ROWS  # inputs of at most this many rows use `bf16`
        self.int8: torch.Tensor | None = None  # [out, in] int8, set by quantize_int8
        self.scale: torch.Tensor | None = None  # [out] fp32: weight = int8 * scale per output feature
        self.int8_way = ""  # how the int8 weight multiplies inputs, set by quantize_int8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self._int8_forward(x)
        if self.bf16 is not None and x.shape[0] <= self.bf16_max_rows and x.dtype == torch.float32:
            return torch.ops.pdserve_bf16.linear_bf16w(x.contiguous(), self.bf16, self.bias)
        if x.shape[0] <= self.kernel_to:
            return torch.ops.pdserve_linear.linear_f32w(x.contiguous(), self.panels, self.out_features, self.bias)
        if self.packed is not None and x.shape[0] >= self.packed_from:
            return self._packed_forward(x)
        if self.weight.dtype != x.dtype:  # a bf16-stored weight (store_bf16): fp32 arithmetic all the same
            return linear_widening(x, self.weight, None, self.bias)
        return F.linear(x, self.weight, self.bias)

    def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _int8_forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.int8 is not None and self.scale is not None
        if self.int8_way == "kernel" and x.shape[0] <= NARROW_MAX_ROWS:
            return torch.ops.pdserve_linear.linear_int8w(x.contiguous(), self.int8, self.scale, self.bias)
        if self.int8_way == "int8pack":
            # torch's own weight-only int8 GEMM: (x @ int8^T) * scale, the scale applied to the sums.
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.int8, self.scale)
            return y if self.bias is None else y + self.bias
        return linear_widening(x, self.int8, self.scale, self.bias)

    def pack(self, keep_weight: bool) -> None:
        """Reorder the weight for oneDNN. Without `keep_weight` the plain copy is freed (the packed
        one is then the only one); a weight shared with the embedding must be kept."""
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        if not keep_weight:
            self.drop_plain()

    def drop_plain(self) -> None:
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def use_kernel(self, rows: int) -> None:
        """Run inputs of at most `rows` rows through our kernel (0: none), which reads its own copy of
        the weight (pack_panels, made on first use)."""
        if rows and self.panels is None:
            self.panels = pack_panels(self.weight.detach())
        self.kernel_to = rows

    def free_unused(self, keep_plain: bool) -> None:
        """After tuning: free the copies of the weight that no row count runs. The plain one goes
        where our kernel and the packed weight cover every row count, unless `keep_plain` (a weight
        read elsewhere: a tied embedding, a drafter's head)."""
        if not self.kernel_to:
            self.panels = None
        if self.packed_from == NEVER_PACKED:
            self.packed = None  # F.linear (or our kernel) at every row count
        elif self.packed_from <= self.kernel_to + 1 and not keep_plain:
            self.drop_plain()

    def share_weights(self, other: Linear) -> None:
        """Multiply as `other` does, with its tensors (no copy): every form of its weight and the row
        counts that choose between them. Here, beside the fields they are set from, so that a form
        added to Linear is shared too."""
        self.weight, self.bias = other.weight, other.bias
        self.packed, self.packed_from = other.packed, other.packed_from
        self.panels, self.kernel_to = other.panels, other.kernel_to
        self.bf16, self.bf16_max_rows = other.bf16, other.bf16_max_rows
        self.int8, self.scale, self.int8_way = other.int8, other.scale, other.int8_way

    def keep_bf16(self, weight: torch.Tensor) -> None:
        """Multiply inputs of few rows by `weight` rounded to bfloat16 (in fp32 arithmetic; needs
        bf16_linear_available()). The fp32 weight (or its packed copy) still serves bigger inputs."""
        self.bf16 = weight.detach().to(torch.bfloat16).contiguous()

    def store_bf16(self) -> None:
        """Keep the weight in bfloat16 only (its values must already be bf16-rounded to lose
        nothing); the arithmetic stays in the input's dtype. Not for packed linears."""
        self.weight = nn.Parameter(self.weight.detach().to(torch.bfloat16).contiguous(), requires_grad=False)
        self.packed = None
        if self.weight.device.type == "cpu" and bf16_linear_available():
            # The bf16 kernel, straight from this copy, up to NARROW_MAX_ROWS rows: its alternative
            # is no ready fp32 weight but one widened block by block (linear_widening).
            self.bf16, self.bf16_max_rows = self.weight.detach(), NARROW_MAX_ROWS

    def quantize_int8(self) -> None:
        """Keep the weight as int8 with a scale per output feature (quantize_int8) and free the
        plain one; the arithmetic stays in the input's dtype. Not for packed linears."""
        weight = self.weight.detach()
        self.int8, self.scale = quantize_int8(weight)
        self.packed, self.bf16 = None, None
        self.drop_plain()
        # How inputs (of the weight's dtype, the activations') get multiplied; decided here, where
        # asking is allowed, not in a forward that torch.compile may trace.
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and linear_kernels_available():
            self.int8_way = "kernel"  # few rows; bigger inputs: linear_widening
        elif weight.device.type == "cuda" and int8pack_mm_works(str(weight.device), weight.dtype):
            self.int8_way, self.scale = "int8pack", self.scale.to(weight.dtype)
        else:
            self.int8_way = "widen"


class GateUpLinear(Linear):
    """A gated MLP's gate_proj and up_proj stacked into one weight, with `silu_and_mul`.

    Packed, its halves are reordered apart (the same bytes as the stack): for inputs that run packed,
    oneDNN applies SiLU to the gate GEMM's output and multiplies the up GEMM's by it as post-ops, so
    the [rows, 2 * n] projection is never written out and read back. On a long prompt that round
    trip, with the separate activation and product, took longer than the fused GEMMs add
    (benchmarks/results/mlp.txt)."""

    def __init__(self, in_features: int, intermediate_size: int, bias: bool) -> None:
        n = intermediate_size
        super().__init__(in_features, 2 * n, bias=bias, shards={"gate_proj": n, "up_proj": n})
        self.bias_halves: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def pack(self, keep_weight: bool) -> None:
        n = self.out_features // 2
        with torch.no_grad():
            w = self.weight.detach()
            self.packed = (torch.ops.mkldnn._reorder_linear_weight(w[:n].contiguous(), None),
                           torch.ops.mkldnn._reorder_linear_weight(w[n:].contiguous(), None))
            if self.bias is not None:
                self.bias_halves = (self.bias[:n].contiguous(), self.bias[n:].contiguous())
        if not keep_weight:
            self.drop_plain()

    def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        assert isinstance(self.packed, tuple)
        return torch.cat([torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
                          for w, b in zip(self.packed, self.bias_halves)], dim=-1)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU(x @ gate^T + b_gate) * (x @ up^T + b_up)."""
        # The packed weight serves x where forward would run it; a linear with a bf16 copy (keep_bf16)
        # runs it for few rows first, and int8 or bf16-stored linears are never packed.
        rows = x.shape[0]
        if isinstance(self.packed, tuple) and self.bf16 is None and rows > self.kernel_to and rows >= self.packed_from:
            (gate, up), (gate_bias, up_bias) = self.packed, self.bias_halves
            activated = torch.ops.mkldnn._linear_pointwise(x, gate, gate_bias, "swish", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(x, activated, up, up_bias, "mul")
        return fused_ops.silu_and_mul(self(x))


# Inputs of at most this many rows use a Linear's bf16 weight: up to 8 rows the bf16 kernel beats fp32
# MKL and oneDNN on the bundled model's shapes (at 16 it lost to both on a Xeon with AMX,
# benchmarks/results/bf16_linear.txt).
BF16_MAX_ROWS = 8
BF16_CFLAGS = ["-O3", "-march=native", "-fopenmp"]  # (omp simd may reassociate the scalar tail's sums)


@functools.cache
def bf16_linear_available() -> bool:
    """Build (or load the cached build of) the bf16-weight linear kernel; False where that fails."""
    return cpp_build.build("bf16_linear.cpp", BF16_CFLAGS, "bf16-weight linear")


def gemm_weight(lin: Linear) -> torch.Tensor:
    """The weight the fused MTP ops (worker/csrc/bf16_linear.cpp) multiply inputs of more than
    BF16_MAX_ROWS rows by: a `keep_bf16` linear's bf16 copy where the CPU does bf16 math (oneDNN's
    bf16 GEMM, AMX: from 9 rows it beats fp32 MKL, benchmarks/results/bf16_linear.txt), else its
    fp32 weight, or none (empty: the bf16 kernel at every row count) where the weight is stored in
    bf16 only (store_bf16: a bf16 target's lm_head doubling as the draft head)."""
    if lin.bf16 is not None and native_bf16_cpu():
        return lin.bf16
    return lin.weight.detach() if lin.weight.dtype == torch.float32 else torch.empty(0)


# Inputs of at most this many rows go through the kernel of a narrow weight (store_bf16,
# quantize_int8); bigger ones (prefill chunks) through oneDNN on the weight widened a block at a
# time (linear_widening): the kernel's cost grows with every row, the GEMM's much less, and they
# cross near here for both int8 and bf16 (benchmarks/results/quantization.md).
NARROW_MAX_ROWS = 64
LINEAR_CFLAGS = ["-O3", "-march=native", "-fopenmp"]


# Output features a narrow weight is widened by at a time for many input rows (linear_widening):
# small enough that the widened block stays in cache while it is multiplied, big enough that the
# Python loop over blocks costs little next to the GEMMs (benchmarks/results/quantization.md).
WIDEN_BLOCK = 512


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 [out, in] weight as our kernel reads it (worker/csrc/panel_linear.h): panels of
    P = panel_width() output features, [ceil(out / P), in, P], the last one padded with zeros."""
    width = torch.ops.pdserve_linear.panel_width()
    out_features, in_features = weight.shape
    padded = F.pad(weight, (0, 0, 0, -out_features % width))
    return padded.view(-1, width, in_features).transpose(1, 2).contiguous()


def linear_widening(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """x @ (weight * scale)^T (+ bias) for a narrow weight (bf16, or int8 with a scale per output
    feature) and inputs of many rows: the weight is dequantized WIDEN_BLOCK output features at a time
    into one small buffer of x's dtype, and oneDNN (or MKL) multiplies each block while it is in
    cache. Widening the whole weight for the call instead writes an fp32 copy of it to memory,
    reads it back, and allocates it anew each call. The arithmetic is the reference's: fp32 GEMM
    on the dequantized weight."""
    out_features = weight.shape[0]
    y = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)
    block = torch.empty(min(WIDEN_BLOCK, out_features), weight.shape[1], dtype=x.dtype, device=x.device)
    onednn = can_pack(x.dtype, x.device.type)  # oneDNN's GEMM beats MKL's on a plain weight too
    for start in range(0, out_features, WIDEN_BLOCK):
        stop = min(start + WIDEN_BLOCK, out_features)
        w = block[: stop - start]
        w.copy_(weight[start:stop])
        if scale is not None:
            w.mul_(scale[start:stop, None])
        if onednn:
            y[:, start:stop] = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        else:
            torch.mm(x, w.t(), out=y[:, start:stop])
    return y if bias is None else y.add_(bias)


@functools.cache
def linear_kernels_available() -> bool:
    """Build (or load the cached build of) the fp32- and int8-weight linear kernels; False where that fails."""
    return cpp_build.build("linear_kernels.cpp", LINEAR_CFLAGS, "fp32/int8-weight linear")


@functools.cache
def int8pack_mm_works(device: str, dtype: torch.dtype) -> bool:
    """Whether torch's `_weight_int8pack_mm` takes `dtype` inputs on `device` (it checks the
    activation's dtype and the shapes per backend and version); asked once with a tiny call."""
    try:
        x = torch.zeros(1, 32, dtype=dtype, device=device)
        torch.ops.aten._weight_int8pack_mm(x, torch.zeros(8, 32, dtype=torch.int8, device=device),
                                           torch.ones(8, dtype=dtype, device=device))
    except (RuntimeError, NotImplementedError) as e:
        logger.info("int8 weights: torch's _weight_int8pack_mm does not take %s on %s (%s); widening the "
                    "weight per call instead", dtype, device, e)
        return False
    return True


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only symmetric int8 with one scale per output feature (row): scale = max|row| / 127,
    q = round(w / scale) in [-127, 127], computed in fp32. Returns (q [out, in] int8, scale [out] fp32).
    dequantize_int8(q, scale) is the weight the model then computes with (and the one a reference
    model must hold)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale is exact
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 weight an int8 one stands for: each element times its row's scale (in fp32)."""
    return q.float() * scale[:, None]


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


def pack_linears(model: nn.Module, device: str, shared: set[int], skip: Sequence[nn.Module] = ()) -> None:
    """Pack every `Linear` of `model` whose dtype oneDNN handles well here, then choose per weight
    shape between our kernel, the plain and the packed weight by row count (`tune_linears`) and free
    what is never used; plain weights whose id is in `shared` (tied embeddings, a drafter's head)
    are always kept. Linears inside the modules of `skip` stay plain."""
    unpacked = {id(m) for part in skip for m in part.modules()}
    packed = [m for m in model.modules() if isinstance(m, Linear) and id(m) not in unpacked
              and m.int8 is None and m.weight.numel() and can_pack(m.weight.dtype, device)]
    for module in packed:
        module.pack(keep_weight=True)
    tune_linears(packed, shared=shared)


# Row counts at which tune_linears times each way. Above the last, the library chosen at the last
# stands (both are compute-bound GEMMs there, alike within a few percent at 64..1536 rows):
# NEVER_PACKED means F.linear at every row count past our kernel's, and the packed weight is freed.
TUNE_ROWS = (1, 2, 4, 8, 16, 32, 64)
NEVER_PACKED = sys.maxsize  # a Linear's packed_from where no row count runs the packed weight


def tune_linears(linears: list[Linear], reps: int = 9, timer: Callable[[], float] = time.perf_counter,
                 record: Path | None = None, shared: set[int] | None = None) -> None:
    """Set each packed Linear's `kernel_to` and `packed_from`, per weight shape: our kernel
    (linear_kernels.cpp) for the row counts of TUNE_ROWS where it is at least as fast as both
    libraries from the first one on, then the threshold (one of TUNE_ROWS, or past the last: never)
    between MKL's F.linear and oneDNN's packed weight that makes the remaining row counts cheapest in
    all (`_cheapest_first`). At most two linears of a shape are timed, which bounds the cost for a big
    model.

    The choice is kept in `record` (default: tuning_record(); None when PDSERVE_LINEAR_TUNING=off), a
    JSON file per machine: an engine takes a shape's choice from there when an engine before it
    (or its sibling, starting at the same moment: a file lock orders them) made one. Some shapes are
    near-ties whose sweeps come out either way, and engines that chose apart served at different
    speeds; with the record every engine of the machine runs what the first one chose.

    With `shared` (pack_linears), each linear then frees the copies of its weight it never runs
    (Linear.free_unused; plain weights whose id is in `shared` stay), one linear after the other, so
    that besides two copies of the weights at most one linear's third copy (its panels) is held."""
    shapes: dict[tuple, list[Linear]] = {}
    for lin in linears:
        if lin.packed is not None and lin.weight.numel():  # (both weights at hand)
            shapes.setdefault(_shape(lin), []).append(lin)
    record = tuning_record() if record is None else record
    with _locked(record) as known:
        section = known.setdefault(_machine(), {})
        todo = [shape for shape in shapes if _key(shape) not in section]
        seconds = _time_each_way([lin for shape in todo for lin in shapes[shape][:2]], reps, timer) if todo else {}
        for shape in todo:
            section[_key(shape)] = _choose({way: seconds[shape, way] for way in WAYS})
    chosen = []
    for shape, group in shapes.items():
        choice = section[_key(shape)]
        kernel_rows, first = choice["kernel_rows"], choice["packed_first"]
        packed_from = _packed_from(first)
        # (A recorded choice of our kernel needs it loaded in this process too, and built here.)
        kernel_to = TUNE_ROWS[kernel_rows - 1] if kernel_rows and linear_kernels_available() else 0
        packed_from = max(packed_from, kernel_to + 1)
        for lin in group:
            lin.packed_from = packed_from
            lin.use_kernel(kernel_to)
            if shared is not None:
                lin.free_unused(keep_plain=id(lin.weight) in shared)
        when = f"packed from {packed_from} rows" if packed_from != NEVER_PACKED else "never packed"
        chosen.append(f"{_key(shape)} kernel to {kernel_to} rows, {when}")
    if chosen:
        logger.info("linears (%s): %s", "tuned here" if todo else f"as recorded in {record}", ", ".join(chosen))


def _packed_from(first: int) -> int:
    """The fewest rows that run the packed weight when it won the sweeps from TUNE_ROWS[first] on
    (len: never, past the last). The row counts between two swept ones go with the larger: at 3
    rows MKL's F.linear costs about three GEMVs where the packed weight costs about what it does at
    4, so rounding down to F.linear, never timed there, can make a 3-row step several times slower."""
    if first >= len(TUNE_ROWS):
        return NEVER_PACKED
    return TUNE_ROWS[first - 1] + 1 if first else TUNE_ROWS[0]


def tuning_record() -> Path | None:
    """Where tune_linears keeps its choices: PDSERVE_LINEAR_TUNING (a path, or "off" for none),
    by default ~/.cache/pdserve/linear_tuning.json."""
    where = settings.LINEAR_TUNING.get() or str(Path.home() / ".cache" / "pdserve" / "linear_tuning.json")
    return None if where == "off" else Path(where)


@contextlib.contextmanager
def _locked(record: Path | None) -> Iterator[dict]:
    """The record's contents, written back on exit, under an exclusive lock (an empty dict, kept
    nowhere, without a record or where it cannot be written)."""
    if record is None:
        yield {}
        return
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        lock = open(record.with_suffix(".lock"), "w")  # noqa: SIM115 - held across the yield
    except OSError as e:
        logger.warning("linear tuning: cannot use %s (%s); tuning for this engine only", record, e)
        yield {}
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            known = json.loads(record.read_text()) if record.exists() else {}
        except (OSError, ValueError):
            known = {}  # unreadable: tuned afresh and rewritten
        yield known
        try:
            tmp = record.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
            tmp.replace(record)
        except OSError as e:
            logger.warning("linear tuning: cannot write %s (%s)", record, e)


def _machine() -> str:
    """What a choice depends on besides the shape: the CPU, torch (its MKL and oneDNN), the threads."""
    model, flags = "unknown CPU", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].strip()
    except OSError:
        pass
    digest = hashlib.sha1(flags.encode()).hexdigest()[:8]
    ways = "+".join(WAYS)  # a record of other ways (an older pdserve) holds other choices
    return (f"{model} (flags {digest}) | torch {torch.__version__} | {torch.get_num_threads()} threads | {ways}"
            f" | rule {CHOICE_RULE}")


def _key(shape: tuple) -> str:
    return f"{shape[0]}x{shape[1]} {str(shape[2]).removeprefix('torch.')}"


# The ways tune_linears times a weight shape: our kernel, F.linear (MKL), oneDNN's packed weight.
WAYS = ("kernel", "plain", "packed")


def _use(lin: Linear, way: str) -> None:
    lin.use_kernel(TUNE_ROWS[-1] if way == "kernel" else 0)
    lin.packed_from = 0 if way == "packed" else NEVER_PACKED


def _time_each_way(timed: list[Linear], reps: int, timer: Callable[[], float]) -> dict[tuple, list[float]]:
    """(shape, way) -> per TUNE_ROWS entry, the fastest sweep's seconds for the linears of that
    shape (inf for our kernel where it could not be built). Sweeps run over the linears in model
    order, as a forward runs them (each finds the caches as a forward leaves them), the ways in
    turn, their order rotated rep by rep.

    The fastest, not the median: an engine tunes while its siblings start (the server, the other
    engine, a second server in a benchmark), and a process sharing the core delays most of the
    sweeps of a row count, not all; with the median two servers of the same code chose different
    thresholds and served at different speeds."""
    shapes = {_shape(lin) for lin in timed}
    ways = WAYS if linear_kernels_available() else WAYS[1:]
    seconds: dict[tuple, list[float]] = {(shape, way): [] for shape in shapes for way in WAYS}
    with torch.inference_mode():
        for rows in TUNE_ROWS:
            inputs = {shape: torch.randn(rows, shape[0]).to(shape[2]) for shape in shapes}
            samples: dict[tuple, list[float]] = {key: [math.inf] for key in seconds}
            for rep in range(reps):
                for way in ways[rep % len(ways):] + ways[:rep % len(ways)]:
                    total = dict.fromkeys(shapes, 0.0)
                    for lin in timed:
                        _use(lin, way)
                        start = timer()
                        lin(inputs[_shape(lin)])
                        total[_shape(lin)] += timer() - start
                    for shape, t in total.items():
                        samples[shape, way].append(t)
            for key, times in samples.items():
                seconds[key].append(min(times))
    return seconds


# oneDNN's packed weight must be this much faster than MKL's F.linear in the sweeps at a row count to
# count as faster there. In a forward a near-tie between the two often goes the other way, and sweeps
# a few percent apart are within this box's noise, so engines built a minute apart split such ties
# differently; clear wins are not near the margin (benchmarks/results/quantization.md). Our kernel
# against the libraries is a plain comparison: with the margin there too it lost row counts (4 rows
# of a 0.44B model's MLP) where it was the faster in the sweeps and in the decode step
# (benchmarks/results/quantization.md, "Our kernel or a library").
LIBRARY_MARGIN = 1.15
# Which rule of `_choose`, timing which kernel, made a record's choices: a record made under an
# earlier one (2: our kernel read the weight in rows, not panels; 1: it was held to the margin too)
# is tuned again rather than read.
CHOICE_RULE = 3


def _choose(seconds: dict[str, list[float]]) -> dict[str, int]:
    """From per-way sweep times over TUNE_ROWS: `kernel_rows`, how many of the first row counts run
    our kernel (each where it is at least as fast as both libraries, from the first on: a few rows
    is where a GEMM library reads the weight slowest), and `packed_first`, the index into TUNE_ROWS
    from which the packed weight runs (len: never) among the rest. Past the last row count its
    choice stands, so where our kernel won every row count the last one still chooses between the
    libraries for bigger inputs (prefill chunks)."""
    kernel, plain, packed = seconds["kernel"], seconds["plain"], seconds["packed"]
    rows = 0
    while rows < len(TUNE_ROWS) and kernel[rows] <= min(plain[rows], packed[rows]):
        rows += 1
    rest = min(rows, len(TUNE_ROWS) - 1)
    return {"kernel_rows": rows, "packed_first": rest + _cheapest_first(packed[rest:], plain[rest:])}


def _cheapest_first(packed: list[float], plain: list[float]) -> int:
    """The index into these row counts from which running packed costs least over all of them
    (len: never), each row count's time relative to its faster way and packed's handicapped by
    LIBRARY_MARGIN: a near-tie then costs next to nothing either way, where a rule like "packed
    wins from here on" would move the threshold with the noise."""
    packed = [t * LIBRARY_MARGIN for t in packed]
    best = [min(a, b) or 1e-12 for a, b in zip(packed, plain)]
    return min(range(len(best) + 1),
               key=lambda first: sum((packed[i] if i >= first else plain[i]) / best[i] for i in range(len(best))))


def _shape(lin: Linear) -> tuple[int, int, torch.dtype]:
    return lin.in_features, lin.out_features, lin.weight.dtype


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
