"""Run-time checks of the request-state invariants I1-I5 (docs/architecture.md, request-state invariants).

On when `PDSERVE_DEBUG_INVARIANTS=1` (the test suite sets it). They read device tensors back,
so they cost a sync per step: debug only. A violation raises `InvariantViolation` naming the
invariant, the slot and the request.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engine import settings

if TYPE_CHECKING:
    from scheduler.output import SchedulerOutput
    from worker.states import RequestStates


class InvariantViolation(AssertionError):
    pass


def enabled() -> bool:
    return settings.DEBUG_INVARIANTS.get()


def _fail(rule: str, states: RequestStates, slot: int, what: str) -> None:
    raise InvariantViolation(f"{rule} violated for slot {slot} (request {states.slot_req_id[slot]!r}): {what}")


def check_admission(states: RequestStates, slot: int) -> None:
    """I2 + I3 right after a request enters a slot."""
    drafts = states.draft_tokens[slot].tolist()
    if any(d != -1 for d in drafts) or states.num_draft_tokens[slot] != 0:
        _fail("I2/I3", states, slot, f"draft tokens not reset on admission: {drafts}")
    if states.mtp_pending[slot] != 0:
        _fail("I2", states, slot, f"{states.mtp_pending[slot]} stashed MTP positions not reset on admission")
    total = int(states.total_len_np[slot])
    if states.num_computed_tokens_np[slot] > 0:
        last = int(states.last_sampled_tokens[slot])
        want = int(states.all_token_ids[slot, total - 1])
        if last != want:
            _fail("I2", states, slot, f"last_sampled_token={last} but all_token_ids[{total - 1}]={want}")


def check_step(states: RequestStates, sched: SchedulerOutput, req_ids: list[str], slots: np.ndarray,
               is_prefilling: np.ndarray, num_drafts: np.ndarray) -> None:
    authoritative = {r.req_id: r.num_computed_tokens for r in sched.new_requests}
    authoritative.update({r.req_id: r.num_computed_tokens for r in sched.cached_requests})
    total_dev = states.total_len.tolist()
    last_dev = states.last_sampled_tokens.tolist()
    for b, (req_id, slot) in enumerate(zip(req_ids, slots.tolist())):
        mirror = int(states.num_computed_tokens_np[slot])
        if mirror != authoritative[req_id]:
            _fail("I4", states, slot,
                  f"runner mirror num_computed_tokens={mirror}, scheduler says {authoritative[req_id]}")
        prefill_len = int(states.prefill_len[slot])
        if bool(is_prefilling[b]) != (min(mirror, prefill_len) < prefill_len):
            _fail("I5", states, slot, "is_prefilling disagrees with num_computed vs prefill_len")
        total = int(states.total_len_np[slot])
        if total_dev[slot] != total:
            _fail("I1", states, slot, f"device total_len={total_dev[slot]} but host mirror={total}")
        if not is_prefilling[b]:
            if mirror != total - 1:
                _fail("I1", states, slot, f"decode query must start at total_len-1={total - 1}, num_computed={mirror}")
            want = int(states.all_token_ids[slot, total - 1])
            if last_dev[slot] != want:
                _fail("I1", states, slot, f"last_sampled_token={last_dev[slot]} but all_token_ids[{total - 1}]={want}")
            k = int(num_drafts[b])
            if k and min(states.draft_tokens[slot, :k].tolist()) < 0:
                _fail("I3", states, slot, f"{k} drafts scheduled but a placeholder (-1) is among them")
