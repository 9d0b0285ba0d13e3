"""Per-step token-bookkeeping kernels of the model runner.

Per-request state lives in fixed slots (docs/architecture.md, request-state invariants): ``all_token_ids`` is a
``[S, L]`` table, ``total_len`` / ``last_sampled_tokens`` are ``[S]`` and
``draft_tokens`` is ``[S, K]``.  Each step the runner builds a flat
``input_ids`` buffer of ``T`` tokens for ``B`` scheduled requests (batch rows),
where row ``b`` lives in slot ``idx_mapping[b]`` and owns
``input_ids[query_start_loc[b]:query_start_loc[b + 1]]``.

Three kernels move tokens between the slot tables and the flat batch:

* :func:`gather_prefill_tokens` - prefill rows copy their next prompt chunk
  from ``all_token_ids``.
* :func:`combine_sampled_and_draft_tokens` - decode rows get
  ``[last_sampled_token, draft_0, ..., draft_{k-1}]``.
* :func:`post_step_update` - append the tokens sampled this step to the slot
  tables and remember the last one.

Each exists as a Triton kernel (used for CUDA tensors) and as a vectorised
pure-torch reference (used elsewhere).  Both work in place and neither reads a
device value back to the host, so they never force a host/device sync.

Dispatch: ``PDSERVE_USE_TRITON=1`` forces Triton (with ``TRITON_INTERPRET=1``
this runs on CPU tensors, which the tests use), ``PDSERVE_USE_TRITON=0``
forces torch, otherwise Triton is used iff the tensors are on CUDA.  Triton is
imported behind a guard: without it every call takes the torch path.

Note that Triton decides whether a ``@triton.jit`` function is interpreted
when it is *decorated*, i.e. when this module is imported, so
``TRITON_INTERPRET`` must be set before the first import of this module.

Preconditions shared by all kernels (callers guarantee them; they are not
checked on device because that would need a sync):

* the slots in ``idx_mapping`` are distinct (two rows writing one slot race);
* ``query_start_loc`` is non-decreasing.

Index bounds that a buggy caller could violate (a chunk running past ``L``, more
drafts than the row's query has room for, ``num_sampled > M``) are clamped
identically in both implementations, so a bad step can lose tokens but can
never write into another row or slot.
"""

import logging

import torch

from engine import settings
from worker import fused_ops

logger = logging.getLogger(__name__)

try:  # Guarded: a box without Triton still imports this module and uses torch.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is a hard dependency in pyproject
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "select_backend",
    "gather_prefill_tokens",
    "combine_sampled_and_draft_tokens",
    "post_step_update",
    "gather_prefill_tokens_torch",
    "combine_sampled_and_draft_tokens_torch",
    "post_step_update_torch",
    "gather_prefill_tokens_triton",
    "combine_sampled_and_draft_tokens_triton",
    "post_step_update_triton",
    "gather_prefill_tokens_cpp",
    "combine_sampled_and_draft_tokens_cpp",
    "post_step_update_cpp",
]

_warned_no_triton = False


# --------------------------------------------------------------------------- #
# Dispatch
# --------------------------------------------------------------------------- #
def select_backend(*tensors: torch.Tensor) -> str:
    """Return ``"triton"``, ``"cpp"`` or ``"torch"`` for a call on ``tensors``.

    ``"cpp"``: CPU int32 tensors while the C++ ops are in use (worker/fused_ops.py; the engine
    enables them at start), the Triton kernels' loops in C++. The env var is read on every call
    (cheap) so tests and operators can flip it without re-importing the module.
    """
    global _warned_no_triton
    forced = settings.USE_TRITON.get()
    cpp = "cpp" if fused_ops.ints_on_cpu(*tensors) else "torch"
    if forced is False:
        return cpp
    wants_triton = forced is True or any(t.is_cuda for t in tensors)
    if not wants_triton:
        return cpp
    if not HAS_TRITON:
        if not _warned_no_triton:
            logger.warning("Triton is not importable; worker kernels fall back to torch.")
            _warned_no_triton = True
        return "torch"
    return "triton"


def gather_prefill_tokens(
    input_ids: torch.Tensor,
    all_token_ids: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    is_prefilling: torch.Tensor,
) -> None:
    """Copy each prefill row's next chunk of tokens into ``input_ids``.

    For every row ``b`` with ``is_prefilling[b]``:
    ``input_ids[qsl[b] + j] = all_token_ids[idx_mapping[b], num_computed_tokens[b] + j]``
    for ``j < qsl[b+1] - qsl[b]``.  Other rows are untouched.

    Shapes: ``input_ids [T]``, ``all_token_ids [S, L]``, ``idx_mapping [B]``,
    ``query_start_loc [B+1]``, ``num_computed_tokens [B]``, ``is_prefilling [B]`` (bool).
    """
    backend = select_backend(input_ids, all_token_ids, idx_mapping, query_start_loc, num_computed_tokens)
    _implementation("gather_prefill_tokens", backend)(
        input_ids, all_token_ids, idx_mapping, query_start_loc, num_computed_tokens, is_prefilling
    )


def combine_sampled_and_draft_tokens(
    input_ids: torch.Tensor,
    last_sampled_tokens: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    is_prefilling: torch.Tensor,
) -> None:
    """Write ``[last_sampled, drafts...]`` into the query of every decode row.

    For every row ``b`` with ``not is_prefilling[b]``, ``s = idx_mapping[b]``,
    ``q = qsl[b]``: ``input_ids[q] = last_sampled_tokens[s]`` and
    ``input_ids[q + 1 + j] = draft_tokens[s, j]`` for ``j < num_draft_tokens[b]``.
    Prefill rows are untouched.  Writes never leave the row's own query span.

    Shapes: ``input_ids [T]``, ``last_sampled_tokens [S]``, ``draft_tokens [S, K]``,
    ``num_draft_tokens [B]``, ``idx_mapping [B]``, ``query_start_loc [B+1]``,
    ``is_prefilling [B]`` (bool).
    """
    backend = select_backend(input_ids, last_sampled_tokens, draft_tokens, num_draft_tokens, idx_mapping,
                             query_start_loc)
    _implementation("combine_sampled_and_draft_tokens", backend)(
        input_ids, last_sampled_tokens, draft_tokens, num_draft_tokens, idx_mapping, query_start_loc, is_prefilling
    )


def post_step_update(
    all_token_ids: torch.Tensor,
    total_len: torch.Tensor,
    last_sampled_tokens: torch.Tensor,
    sampled_token_ids: torch.Tensor,
    num_sampled: torch.Tensor,
    idx_mapping: torch.Tensor,
) -> None:
    """Append this step's sampled tokens to the slot tables.

    For every row ``b`` with ``n = num_sampled[b] > 0``, ``s = idx_mapping[b]``,
    ``t = total_len[s]``: ``all_token_ids[s, t + j] = sampled_token_ids[b, j]``
    for ``j < n``, ``total_len[s] = t + n`` and
    ``last_sampled_tokens[s] = sampled_token_ids[b, n - 1]``.
    Rows with ``n == 0`` (mid-prefill chunks) change nothing.

    Shapes: ``all_token_ids [S, L]``, ``total_len [S]``, ``last_sampled_tokens [S]``,
    ``sampled_token_ids [B, M]``, ``num_sampled [B]``, ``idx_mapping [B]``.
    """
    backend = select_backend(all_token_ids, total_len, last_sampled_tokens, sampled_token_ids, num_sampled,
                             idx_mapping)
    _implementation("post_step_update", backend)(
        all_token_ids, total_len, last_sampled_tokens, sampled_token_ids, num_sampled, idx_mapping
    )


def _implementation(kernel: str, backend: str):
    """`<kernel>_<backend>` of this module (the three implementations share one signature)."""
    return globals()[f"{kernel}_{backend}"]


# --------------------------------------------------------------------------- #
# Torch reference implementations (vectorised, sync-free)
# --------------------------------------------------------------------------- #
def _token_rows(query_start_loc: torch.Tensor, num_tokens: int, num_rows: int):
    """Map every flat token position to its batch row.

    Returns ``(row, j, in_row)``: ``row`` clamped into ``[0, B)`` so it can be
    used as an index, ``j`` the offset inside that row's query, and ``in_row``
    False for positions that belong to no row (e.g. padding after ``qsl[B]``).
    """
    qsl = query_start_loc.long()
    pos = torch.arange(num_tokens, device=query_start_loc.device, dtype=torch.long)
    # Row b owns [qsl[b], qsl[b+1]); the number of row ends <= pos is its row.
    row = torch.searchsorted(qsl[1:].contiguous(), pos, right=True)
    in_row = row < num_rows
    row = row.clamp(max=num_rows - 1)
    j = pos - qsl[row]
    in_row &= j >= 0  # positions before qsl[0] belong to no row
    return row, j, in_row


def gather_prefill_tokens_torch(
    input_ids: torch.Tensor,
    all_token_ids: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    is_prefilling: torch.Tensor,
) -> None:
    """Torch reference of :func:`gather_prefill_tokens`."""
    num_tokens, num_rows = input_ids.shape[0], idx_mapping.shape[0]
    if num_tokens == 0 or num_rows == 0:
        return
    max_len = all_token_ids.shape[1]
    row, j, in_row = _token_rows(query_start_loc, num_tokens, num_rows)
    src_col = num_computed_tokens.long()[row] + j
    take = in_row & is_prefilling.bool()[row] & (src_col < max_len)
    # Clamp so that masked-off positions still index in bounds.
    src = all_token_ids[idx_mapping.long()[row], src_col.clamp(0, max_len - 1)]
    input_ids.copy_(torch.where(take, src.to(input_ids.dtype), input_ids))


def combine_sampled_and_draft_tokens_torch(
    input_ids: torch.Tensor,
    last_sampled_tokens: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    is_prefilling: torch.Tensor,
) -> None:
    """Torch reference of :func:`combine_sampled_and_draft_tokens`."""
    num_tokens, num_rows = input_ids.shape[0], idx_mapping.shape[0]
    max_drafts = draft_tokens.shape[1]
    if num_tokens == 0 or num_rows == 0:
        return
    row, j, in_row = _token_rows(query_start_loc, num_tokens, num_rows)
    qsl = query_start_loc.long()
    query_len = qsl[row + 1] - qsl[row]
    slot = idx_mapping.long()[row]
    # Same clamp as the Triton kernel: drafts never spill past the row or K.
    n_draft = torch.minimum(num_draft_tokens.long()[row], query_len - 1).clamp(max=max_drafts)
    decode = in_row & ~is_prefilling.bool()[row]
    take_last = decode & (j == 0)
    take_draft = decode & (j >= 1) & (j <= n_draft)
    last = last_sampled_tokens[slot].to(input_ids.dtype)
    if max_drafts > 0:
        draft = draft_tokens[slot, (j - 1).clamp(0, max_drafts - 1)].to(input_ids.dtype)
    else:  # no draft column at all: take_draft is all False, any placeholder works
        draft = last
    out = torch.where(take_last, last, torch.where(take_draft, draft, input_ids))
    input_ids.copy_(out)


def post_step_update_torch(
    all_token_ids: torch.Tensor,
    total_len: torch.Tensor,
    last_sampled_tokens: torch.Tensor,
    sampled_token_ids: torch.Tensor,
    num_sampled: torch.Tensor,
    idx_mapping: torch.Tensor,
) -> None:
    """Torch reference of :func:`post_step_update`."""
    num_rows, max_sampled = sampled_token_ids.shape
    if num_rows == 0 or max_sampled == 0:
        return
    max_len = all_token_ids.shape[1]
    slots = idx_mapping.long()
    start = total_len[slots].long()  # read before total_len is updated below
    n = torch.minimum(num_sampled.long().clamp(max=max_sampled), max_len - start).clamp(min=0)

    cols = torch.arange(max_sampled, device=sampled_token_ids.device)
    dest = (start[:, None] + cols).clamp(0, max_len - 1)  # [B, M], in bounds
    # After clamping, a masked-off entry can alias a real write target of the
    # same row.  Give every entry the final value of the cell it targets (the
    # sampled token if the cell is written, else its current value), so
    # duplicate targets write identical values and ordering does not matter.
    rel = dest - start[:, None]
    written = (rel >= 0) & (rel < n[:, None])
    new_tok = sampled_token_ids.gather(1, rel.clamp(0, max_sampled - 1)).to(all_token_ids.dtype)
    slot_rows = slots[:, None].expand(num_rows, max_sampled)
    cur = all_token_ids[slot_rows, dest]
    all_token_ids[slot_rows, dest] = torch.where(written, new_tok, cur)

    total_len[slots] = (start + n).to(total_len.dtype)
    last = sampled_token_ids.gather(1, (n - 1).clamp(min=0)[:, None]).squeeze(1)
    last_sampled_tokens[slots] = torch.where(
        n > 0, last.to(last_sampled_tokens.dtype), last_sampled_tokens[slots]
    )


# --------------------------------------------------------------------------- #
# C++ implementations (CPU; worker/csrc/fused_ops.cpp)
# --------------------------------------------------------------------------- #
def _require_cpp() -> None:
    if not fused_ops.enable():
        raise RuntimeError("the C++ ops are not available; use the *_torch implementations")


def gather_prefill_tokens_cpp(input_ids, all_token_ids, idx_mapping, query_start_loc, num_computed_tokens,
                              is_prefilling) -> None:
    """C++ implementation of :func:`gather_prefill_tokens`."""
    _require_cpp()
    torch.ops.pdserve_fused.gather_prefill_tokens(input_ids, all_token_ids, idx_mapping, query_start_loc,
                                                  num_computed_tokens, is_prefilling.bool())


def combine_sampled_and_draft_tokens_cpp(input_ids, last_sampled_tokens, draft_tokens, num_draft_tokens,
                                         idx_mapping, query_start_loc, is_prefilling) -> None:
    """C++ implementation of :func:`combine_sampled_and_draft_tokens`."""
    _require_cpp()
    torch.ops.pdserve_fused.combine_sampled_and_draft_tokens(input_ids, last_sampled_tokens, draft_tokens,
                                                             num_draft_tokens, idx_mapping, query_start_loc,
                                                             is_prefilling.bool())


def post_step_update_cpp(all_token_ids, total_len, last_sampled_tokens, sampled_token_ids, num_sampled,
                         idx_mapping) -> None:
    """C++ implementation of :func:`post_step_update`."""
    _require_cpp()
    torch.ops.pdserve_fused.post_step_update(all_token_ids, total_len, last_sampled_tokens, sampled_token_ids,
                                             num_sampled, idx_mapping)


# --------------------------------------------------------------------------- #
# Triton implementations
# --------------------------------------------------------------------------- #
def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("Triton is not available; use the *_torch implementations")


def _has_work(empty: bool, **tensors: torch.Tensor) -> bool:
    """Whether a kernel launch has rows to do (not `empty`). Raises where Triton is missing, and where
    a tensor's rows are not contiguous: the kernels take one row stride per tensor and assume unit
    inner stride. The check reads metadata only (no device access), so it is free on the hot path."""
    _require_triton()
    if empty:
        return False
    for name, t in tensors.items():
        if t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride in its last dimension, got {tuple(t.stride())}")
    return True


if HAS_TRITON:

    @triton.jit
    def _gather_prefill_tokens_kernel(
        input_ids_ptr,
        all_token_ids_ptr,
        all_token_ids_stride,
        idx_mapping_ptr,
        query_start_loc_ptr,
        num_computed_tokens_ptr,
        is_prefilling_ptr,
        max_model_len,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        prefilling = tl.load(is_prefilling_ptr + row) != 0
        start = tl.load(query_start_loc_ptr + row)
        end = tl.load(query_start_loc_ptr + row + 1)
        slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
        computed = tl.load(num_computed_tokens_ptr + row)
        # Decode rows get an empty range instead of an early return, so every
        # program runs the same straight-line code.
        n = tl.where(prefilling, end - start, 0)
        n = tl.minimum(n, max_model_len - computed)  # never read past the slot's row
        src = all_token_ids_ptr + slot * all_token_ids_stride + computed
        dst = input_ids_ptr + start
        for off in range(0, n, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            mask = offs < n
            tok = tl.load(src + offs, mask=mask)
            tl.store(dst + offs, tok, mask=mask)

    @triton.jit
    def _combine_sampled_and_draft_tokens_kernel(
        input_ids_ptr,
        last_sampled_tokens_ptr,
        draft_tokens_ptr,
        draft_tokens_stride,
        num_draft_tokens_ptr,
        idx_mapping_ptr,
        query_start_loc_ptr,
        is_prefilling_ptr,
        max_drafts,
        BLOCK_K: tl.constexpr,
    ):
        row = tl.program_id(0)
        prefilling = tl.load(is_prefilling_ptr + row) != 0
        start = tl.load(query_start_loc_ptr + row)
        query_len = tl.load(query_start_loc_ptr + row + 1) - start
        slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
        # Number of positions this row may write: 0 for prefill rows.
        n_write = tl.where(prefilling, 0, query_len)
        has_query = n_write > 0
        last = tl.load(last_sampled_tokens_ptr + slot, mask=has_query, other=0)
        tl.store(input_ids_ptr + start, last, mask=has_query)
        # Drafts never spill past the row's query span or past K.
        n_draft = tl.load(num_draft_tokens_ptr + row)
        n_draft = tl.minimum(tl.minimum(n_draft, n_write - 1), max_drafts)
        offs = tl.arange(0, BLOCK_K)
        mask = offs < n_draft
        draft = tl.load(draft_tokens_ptr + slot * draft_tokens_stride + offs, mask=mask, other=0)
        tl.store(input_ids_ptr + start + 1 + offs, draft, mask=mask)

    @triton.jit
    def _post_step_update_kernel(
        all_token_ids_ptr,
        all_token_ids_stride,
        total_len_ptr,
        last_sampled_tokens_ptr,
        sampled_token_ids_ptr,
        sampled_token_ids_stride,
        num_sampled_ptr,
        idx_mapping_ptr,
        max_model_len,
        max_sampled,
        BLOCK_M: tl.constexpr,
    ):
        row = tl.program_id(0)
        slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
        n = tl.load(num_sampled_ptr + row)
        start = tl.load(total_len_ptr + slot)
        # Same clamp as the torch reference: stay inside the slot's row.
        n = tl.minimum(tl.minimum(n, max_sampled), max_model_len - start)
        n = tl.maximum(n, 0)
        sampled_row = sampled_token_ids_ptr + row.to(tl.int64) * sampled_token_ids_stride
        offs = tl.arange(0, BLOCK_M)
        mask = offs < n
        tok = tl.load(sampled_row + offs, mask=mask, other=0)
        tl.store(all_token_ids_ptr + slot * all_token_ids_stride + start + offs, tok, mask=mask)
        # n == 0 is a mid-prefill chunk: leave the slot exactly as it was.
        has_new = n > 0
        tl.store(total_len_ptr + slot, start + n, mask=has_new)
        last = tl.load(sampled_row + n - 1, mask=has_new, other=0)
        tl.store(last_sampled_tokens_ptr + slot, last, mask=has_new)


_GATHER_BLOCK = 128


def gather_prefill_tokens_triton(
    input_ids: torch.Tensor,
    all_token_ids: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    is_prefilling: torch.Tensor,
) -> None:
    """Triton implementation of :func:`gather_prefill_tokens`."""
    num_rows = idx_mapping.shape[0]
    if not _has_work(num_rows == 0 or input_ids.shape[0] == 0, input_ids=input_ids, all_token_ids=all_token_ids,
                     idx_mapping=idx_mapping, query_start_loc=query_start_loc,
                     num_computed_tokens=num_computed_tokens, is_prefilling=is_prefilling):
        return
    _gather_prefill_tokens_kernel[(num_rows,)](
        input_ids,
        all_token_ids,
        all_token_ids.stride(0),
        idx_mapping,
        query_start_loc,
        num_computed_tokens,
        is_prefilling,
        all_token_ids.shape[1],
        BLOCK=_GATHER_BLOCK,
    )


def combine_sampled_and_draft_tokens_triton(
    input_ids: torch.Tensor,
    last_sampled_tokens: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    is_prefilling: torch.Tensor,
) -> None:
    """Triton implementation of :func:`combine_sampled_and_draft_tokens`."""
    num_rows = idx_mapping.shape[0]
    if not _has_work(num_rows == 0 or input_ids.shape[0] == 0, input_ids=input_ids,
                     last_sampled_tokens=last_sampled_tokens, draft_tokens=draft_tokens,
                     num_draft_tokens=num_draft_tokens, idx_mapping=idx_mapping, query_start_loc=query_start_loc,
                     is_prefilling=is_prefilling):
        return
    max_drafts = draft_tokens.shape[1]
    _combine_sampled_and_draft_tokens_kernel[(num_rows,)](
        input_ids,
        last_sampled_tokens,
        draft_tokens,
        draft_tokens.stride(0),
        num_draft_tokens,
        idx_mapping,
        query_start_loc,
        is_prefilling,
        max_drafts,
        BLOCK_K=triton.next_power_of_2(max(max_drafts, 1)),
        num_warps=1,
    )


def post_step_update_triton(
    all_token_ids: torch.Tensor,
    total_len: torch.Tensor,
    last_sampled_tokens: torch.Tensor,
    sampled_token_ids: torch.Tensor,
    num_sampled: torch.Tensor,
    idx_mapping: torch.Tensor,
) -> None:
    """Triton implementation of :func:`post_step_update`."""
    num_rows, max_sampled = sampled_token_ids.shape
    if not _has_work(num_rows == 0 or max_sampled == 0, all_token_ids=all_token_ids, total_len=total_len,
                     last_sampled_tokens=last_sampled_tokens, sampled_token_ids=sampled_token_ids,
                     num_sampled=num_sampled, idx_mapping=idx_mapping):
        return
    _post_step_update_kernel[(num_rows,)](
        all_token_ids,
        all_token_ids.stride(0),
        total_len,
        last_sampled_tokens,
        sampled_token_ids,
        sampled_token_ids.stride(0),
        num_sampled,
        idx_mapping,
        all_token_ids.shape[1],
        max_sampled,
        BLOCK_M=triton.next_power_of_2(max_sampled),
        num_warps=1,
    )
