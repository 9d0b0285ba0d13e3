"""Deadlines both ways (issue 14, hole 2): a decode reservation that can never fit fails at once,
one stuck behind full memory ends at its deadline, and a prefill's lease expiry reaches the
decode instance as an error instead of a silent free; no block is left behind anywhere.

The deadlines under test run on clocks the test moves (kv_harness.JumpClock, FakeClock): each
scenario waits for the event a deadline stands for and asserts on the counters, never on how
long something took."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import zmq
from conftest import random_prompts
from kv_harness import VOCAB, FakeClock, JumpClock, greedy, held, kv_shape, pd_pair, pulls, pump
from pd_harness import generate_all, wait_blocks_free, wait_until

from engine.config import KVTransferConfig
from engine.request import DecodeHandoff, Request
from engine.types import SamplingParams
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler

GREEDY = greedy(8)
SHAPE = kv_shape()
# Far beyond any real wait in these tests: only the test's clock jumps reach it.
LONG_S = 600.0


def hog_decode_memory(decode, state: dict) -> None:
    """Make a decode engine's memory look full: while `state["hog"]` is set, a hog request holds
    every KV block (taken and given back inside the engine's own thread). `state["turns"]` counts
    the decode loop's scheduling passes, so a test can wait for the loop to have seen a change."""
    sched = decode.core.scheduler
    hog_tokens = sched.blocks.num_blocks * sched.blocks.block_size
    hog = Request("hog", [1] * hog_tokens, SamplingParams())
    state.update(hog=False, turns=0)
    reserve = sched._reserve_remote_kv

    def reserve_with_hog():
        if state["hog"] and not hog.block_ids:
            assert sched.blocks.allocate(hog, hog_tokens) is not None
        elif not state["hog"] and hog.block_ids:
            sched.blocks.free_request(hog)
        reserve()
        state["turns"] += 1

    sched._reserve_remote_kv = reserve_with_hog


def waiting_for_blocks(connector) -> list[DecodeHandoff]:
    """The decode connector's hand-offs still waiting for the scheduler to reserve their blocks."""
    return [h for h in connector.handoffs.values() if h.reserve_by is not None]


def loop_turns(state: dict, n: int = 2) -> None:
    """Wait until the decode loop has made `n` more passes: a clock change made before this call
    has been seen by its deadline checks (they run at every pass)."""
    target = state["turns"] + n
    wait_until(lambda: state["turns"] >= target, 30, "the decode loop to turn", interval=0.005)


def test_reservation_that_cannot_fit_and_one_stuck_behind_full_memory(checkpoints, references, tmp_path):
    model = str(checkpoints["qwen2"])
    clock = JumpClock()
    hooks = {}

    def install(_prefill, decode):
        decode.connector.receiver.clock = clock  # the reservation deadline runs on the receiver's clock
        hog_decode_memory(decode, hooks)

    # 4 blocks of 16 = 64 tokens; ngram drafting reserves 2 lookahead slots: a 62-token prompt (+ t0) can never
    # fit. Not 63 tokens: P's t0 would end that one at max_model_len, a race with D's rejection.
    # max_resumes=0: this is about D's own deadline; failover would re-queue the request (its t0 was
    # streamed) behind the same full memory, up to --max-resumes times.
    with pd_pair(tmp_path, model, 64, decode=dict(num_kv_blocks=4, speculative_method="ngram"),
                 decode_kv=KVTransferConfig(reserve_deadline_s=LONG_S), before_start=install, max_resumes=0) as pd:
        run, decode = pd.run, pd.decode
        connector, stats = decode.connector, decode.connector.receiver.stats
        never, stuck = random_prompts(2, 62, 10, VOCAB, 143)  # 62 and 10 tokens
        hooks["hog"] = True
        (too_big,) = run(generate_all(pd.client, [never], GREEDY, timeout=30))
        assert too_big["finish_reason"] == "error" and "need 5 KV blocks" in too_big["error"], too_big
        assert stats.reservations_expired == 0 and clock.skew == 0  # at once, not at a deadline

        async def stuck_until_its_deadline():
            task = asyncio.ensure_future(generate_all(pd.client, [stuck], GREEDY, timeout=60))
            await asyncio.to_thread(wait_until, lambda: len(waiting_for_blocks(connector)) == 1, 30,
                                    "D to queue the request")
            clock.advance(LONG_S - 1)  # just short of the deadline: still waiting
            await asyncio.to_thread(loop_turns, hooks)
            assert len(waiting_for_blocks(connector)) == 1 and stats.reservations_expired == 0 and not task.done()
            clock.advance(2)  # past it
            return await task

        (waited,) = run(stuck_until_its_deadline(), timeout=90)
        assert waited["finish_reason"] == "error" and "no KV memory" in waited["error"], waited
        assert f"within {LONG_S:g} s" in waited["error"]  # its reservation deadline, not forever
        assert stats.reservations_expired == 1 and not waiting_for_blocks(connector)
        hooks["hog"] = False
        (ok,) = run(generate_all(pd.client, [stuck], GREEDY, timeout=30))  # memory back: it runs
        assert ok["error"] is None
        references["qwen2"].assert_matches(stuck, ok["tokens"], 8)
        run(wait_blocks_free(pd.client, timeout=10))


def test_prefill_lease_expiry_reaches_decode_as_a_clear_error(checkpoints, tmp_path):
    """P's lease runs out while D waits for memory: D's pull gets a KVError at once (not a
    KeepAlive-renewed pending pull until D's own deadline), and the request ends clearly."""
    model = str(checkpoints["qwen2"])
    clock = JumpClock()
    hooks = {}

    def install(prefill, decode):
        prefill.connector.sender.clock = clock  # P's leases run on its sender's clock
        hog_decode_memory(decode, hooks)

    # D's own deadlines are far away (and on the real clock): only P's lease can end the request.
    # max_resumes=0: the error itself is under test; with failover on, the request (t0 streamed) is
    # resumed with a fresh transfer and completes once memory is back.
    with pd_pair(tmp_path, model, 256, decode=dict(num_kv_blocks=16),
                 prefill_kv=KVTransferConfig(lease_s=LONG_S),
                 decode_kv=KVTransferConfig(reserve_deadline_s=LONG_S, deadline_s=LONG_S),
                 before_start=install, max_resumes=0) as pd:
        sender, receiver = pd.prefill.connector.sender, pd.decode.connector.receiver
        hooks["hog"] = True

        async def scenario():
            task = asyncio.ensure_future(generate_all(pd.client, [[5, 6, 7, 8, 9]], GREEDY, timeout=60))
            await asyncio.to_thread(wait_until, lambda: held(sender) and waiting_for_blocks(pd.decode.connector), 30,
                                    "P to hold the KV and D to wait for memory")
            clock.advance(LONG_S + 1)  # P's lease runs out meanwhile
            await asyncio.to_thread(wait_until, lambda: sender.stats.leases_expired == 1, 30, "P's lease to expire")
            hooks["hog"] = False
            return await task

        (result,) = pd.run(scenario(), timeout=90)
        assert result["finish_reason"] == "error" and "lease" in result["error"], result
        assert receiver.stats.transfers_failed == 1
        # Ended by P's word, not by one of D's deadlines.
        assert receiver.stats.reservations_expired == 0 and receiver.stats.transfers_stalled == 0
        pd.run(wait_blocks_free(pd.client, timeout=10))


def test_lease_expiry_is_sent_to_a_decode_that_already_asked(tmp_path: Path):
    """D pulled before P finished, then went quiet: when P's lease expires it sends D a KVError."""
    ctx = zmq.Context()
    clock = FakeClock()  # P's leases; D's clock is the real one (its 60 s deadline never comes)
    released: list[str] = []
    sender = KVSender(ctx, f"ipc://{tmp_path}/p", torch.zeros(SHAPE), "h", "{}", "prefill-0",
                      lambda req_id, _b: released.append(req_id), lease_s=0.3, clock=clock)
    receiver = KVReceiver(ctx, torch.zeros(SHAPE), "h", "{}", "decode-0", deadline_s=60.0)
    try:
        receiver.start("r1", sender.address, [0, 1], "t1", num_tokens=8)
        pump(sender, receiver, until=lambda d, f: ("r1", "t1") in pulls(sender))
        # D stalls (no polls, so no KeepAlive) past P's lease: P's pending pull ends with an error.
        clock.advance(0.29)
        sender.poll()
        assert ("r1", "t1") in pulls(sender) and sender.stats.leases_expired == 0  # not before the lease
        clock.advance(0.02)
        sender.poll()
        assert ("r1", "t1") not in pulls(sender) and ("r1", "t1") in sender.ended
        _, failed = pump(receiver)
        assert [f.req_id for f in failed] == ["r1"] and failed[0].retryable and "prefill" in failed[0].reason
        # A finished prefill arriving after that is for an attempt that already ended: it is held
        # under its own lease and freed on expiry, never sent.
        sender.hold("r1", [0, 1], 8, 3, "t1")
        sender.poll()
        assert not released and held(sender)  # held until its own lease ends
        clock.advance(0.31)
        sender.poll()
        assert released == ["r1"] and not held(sender)
    finally:
        sender.close()
        receiver.close()
        ctx.term()


@pytest.mark.parametrize("lookahead", [0, 2])
def test_fit_check_counts_t0_and_lookahead(lookahead):
    blocks = BlockManager(4, 16, enable_prefix_caching=False)
    sched = Scheduler(4, 64, 64, blocks, connector=None, num_lookahead_tokens=lookahead)  # type: ignore[arg-type]
    fits = Request("fits", [3] * (63 - lookahead), SamplingParams())
    fits.handoff = DecodeHandoff(fits, "p")
    sched.add_request(fits)
    never = Request("never", [3] * (64 - lookahead), SamplingParams())
    never.handoff = DecodeHandoff(never, "p")
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(never)
    assert "never" not in sched.requests
