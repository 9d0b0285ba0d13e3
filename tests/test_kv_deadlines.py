"""Deadlines both ways (issue 14, hole 2): a decode reservation that can never fit fails at once,
one stuck behind full memory ends at its deadline, and a prefill's lease expiry reaches the
decode instance as an error instead of a silent free; no block is left behind anywhere."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import zmq
from conftest import random_prompts
from pd_harness import ThreadedEngines, client_for, generate_all, running_client, wait_blocks_free, wait_ready

from engine.config import EngineConfig
from engine.request import Request
from engine.types import SamplingParams
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler

VOCAB = 384
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SHAPE = (2, 2, 8, 4, 2, 8)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]


def hog_decode_memory(decode, hog_tokens: int) -> dict:
    """Make a decode engine's memory look full: while `state["hog"]` is set, a hog request holds
    `hog_tokens` worth of blocks (taken and given back inside the engine's own thread)."""
    sched = decode.core.scheduler
    hog = Request("hog", [1] * hog_tokens, SamplingParams())
    state = {"hog": False}
    reserve = sched._reserve_remote_kv

    def reserve_with_hog():
        if state["hog"] and not hog.block_ids:
            assert sched.blocks.allocate(hog, hog_tokens) is not None
        elif not state["hog"] and hog.block_ids:
            sched.blocks.free_request(hog)
        reserve()

    sched._reserve_remote_kv = reserve_with_hog
    return state


def warm_up(run, client) -> None:
    """One request through P and D first: a process's first forward loads kernels, which takes
    longer than the short deadlines under test."""
    (result,) = run(generate_all(client, [[4, 5, 6]], GREEDY, timeout=60))
    assert result["error"] is None, result


def test_reservation_that_cannot_fit_and_one_stuck_behind_full_memory(checkpoints, references, tmp_path):
    model = str(checkpoints["qwen2"])
    engines = ThreadedEngines(tmp_path)
    engines.add("prefill", "prefill-0", EngineConfig(model=model, max_model_len=64, num_threads=1))
    # 4 blocks of 16 = 64 tokens; ngram drafting reserves 2 lookahead slots: a 62-token prompt (+ t0) can never
    # fit. Not 63 tokens: P's t0 would end that one at max_model_len, a race with D's rejection.
    decode = engines.add("decode", "decode-0", EngineConfig(model=model, max_model_len=64, num_kv_blocks=4,
                                                            speculative_method="ngram", num_threads=1),
                         kv_reserve_deadline_s=1.0)
    state = hog_decode_memory(decode, 64)
    engines.start()
    # max_resumes=0: this is about D's own deadline; failover would re-queue the request (its t0 was
    # streamed) behind the same full memory, up to --max-resumes times.
    client = client_for(engines.server_addr, model, "pd", 64, max_resumes=0)
    never, stuck = random_prompts(2, 62, 10, VOCAB, 143)  # 62 and 10 tokens
    try:
        with running_client(client) as run:
            run(wait_ready(client))
            warm_up(run, client)
            state["hog"] = True
            start = time.monotonic()
            (too_big,) = run(generate_all(client, [never], GREEDY, timeout=10))
            assert too_big["finish_reason"] == "error" and "need 5 KV blocks" in too_big["error"], too_big
            assert time.monotonic() - start < 1.0  # at once, not at a deadline
            start = time.monotonic()
            (waited,) = run(generate_all(client, [stuck], GREEDY, timeout=10))
            took = time.monotonic() - start
            assert waited["finish_reason"] == "error" and "no KV memory" in waited["error"], waited
            assert 0.9 < took < 3.0, took  # its 1 s reservation deadline, not forever
            assert decode.connector.receiver.stats.reservations_expired == 1
            state["hog"] = False
            (ok,) = run(generate_all(client, [stuck], GREEDY, timeout=20))  # memory back: it runs
            assert ok["error"] is None
            references["qwen2"].assert_matches(stuck, ok["tokens"], 8)
            run(wait_blocks_free(client, timeout=5))
    finally:
        engines.stop()


def test_prefill_lease_expiry_reaches_decode_as_a_clear_error(checkpoints, tmp_path):
    """P's lease runs out while D waits for memory: D's pull gets a KVError at once (not a
    KeepAlive-renewed pending pull until D's own deadline), and the request ends clearly."""
    model = str(checkpoints["qwen2"])
    engines = ThreadedEngines(tmp_path)
    prefill = engines.add("prefill", "prefill-0", EngineConfig(model=model, max_model_len=256, num_threads=1),
                          kv_lease_s=0.5)
    decode = engines.add("decode", "decode-0", EngineConfig(model=model, max_model_len=256, num_kv_blocks=16,
                                                            num_threads=1))
    state = hog_decode_memory(decode, 256)
    engines.start()
    # max_resumes=0: the error itself is under test; with failover on, the request (t0 streamed) is
    # resumed with a fresh transfer and completes once memory is back.
    client = client_for(engines.server_addr, model, "pd", 256, max_resumes=0)
    try:
        with running_client(client) as run:
            run(wait_ready(client))
            warm_up(run, client)
            state["hog"] = True

            async def scenario():
                import asyncio

                task = asyncio.ensure_future(generate_all(client, [[5, 6, 7, 8, 9]], GREEDY, timeout=20))
                await asyncio.sleep(1.5)  # P's 0.5 s lease has run out meanwhile
                assert prefill.connector.sender.stats.leases_expired == 1
                state["hog"] = False
                return await task

            start = time.monotonic()
            (result,) = run(scenario(), timeout=30)
            assert time.monotonic() - start < 5.0
            assert result["finish_reason"] == "error" and "lease" in result["error"], result
            assert decode.connector.receiver.stats.transfers_failed == 1
            run(wait_blocks_free(client, timeout=5))
    finally:
        engines.stop()


def test_lease_expiry_is_sent_to_a_decode_that_already_asked(tmp_path: Path):
    """D pulled before P finished, then went quiet: when P's lease expires it sends D a KVError."""
    ctx = zmq.Context()
    released: list[str] = []
    sender = KVSender(ctx, f"ipc://{tmp_path}/p", torch.zeros(SHAPE), "h", "{}", "prefill-0",
                      lambda req_id, _b: released.append(req_id), lease_s=0.3)
    receiver = KVReceiver(ctx, torch.zeros(SHAPE), "h", "{}", "decode-0", deadline_s=60.0)
    try:
        receiver.start("r1", sender.address, [0, 1], "t1", num_tokens=8)
        deadline = time.monotonic() + 5
        while ("r1", "t1") not in sender.pulls and time.monotonic() < deadline:
            sender.poll()
            receiver.poll()
            time.sleep(0.005)
        assert ("r1", "t1") in sender.pulls
        # D stalls (no polls, so no KeepAlive) past P's lease: P's pending pull ends with an error.
        time.sleep(0.4)
        sender.poll()
        assert ("r1", "t1") not in sender.pulls and ("r1", "t1") in sender.ended
        failed = []
        while not failed and time.monotonic() < deadline:
            failed = receiver.poll()[1]
            time.sleep(0.005)
        assert [f.req_id for f in failed] == ["r1"] and failed[0].retryable and "prefill" in failed[0].reason
        # A finished prefill arriving after that is for an attempt that already ended: it is held
        # under its own lease and freed on expiry, never sent.
        sender.hold("r1", [0, 1], 8, 3, "t1")
        time.sleep(0.4)
        sender.poll()
        assert released == ["r1"] and not sender.held
    finally:
        sender.close()
        receiver.close()
        ctx.term()


@pytest.mark.parametrize("lookahead", [0, 2])
def test_fit_check_counts_t0_and_lookahead(lookahead):
    blocks = BlockManager(4, 16, enable_prefix_caching=False)
    sched = Scheduler(4, 64, 64, blocks, connector=None, num_lookahead_tokens=lookahead)  # type: ignore[arg-type]
    fits = Request("fits", [3] * (63 - lookahead), SamplingParams())
    fits.kv_source = "p"
    sched.add_request(fits)
    never = Request("never", [3] * (64 - lookahead), SamplingParams())
    never.kv_source = "p"
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(never)
    assert "never" not in sched.requests
