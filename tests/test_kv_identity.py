"""Transfer identity (issue 14, hole 1): every KV transfer is (request id, transfer id, P instance);
a decode instance takes only the transfer it expects, and the router spreads prefills evenly."""
from __future__ import annotations

import asyncio
import threading
import time

import torch
from conftest import random_prompts
from kv_harness import VOCAB, greedy, held, pulls
from pd_harness import (
    ThreadedEngines,
    client_for,
    generate_all,
    running_client,
    wait_blocks_free,
    wait_ready,
    wait_until,
)

from engine import messages as em
from engine.config import EngineConfig
from engine.types import EngineRole
from server.engine_router import EngineState, Instance
from server.metrics import ServerMetrics
from server.pd_client import RemoteEngineClient, Tracked

NEW = 12
GREEDY = greedy(NEW)


def install_stall(proc, state: dict) -> None:
    """The first prefill to run a step freezes inside it, after D's pull for the request reached its
    KV port, until `state["release"]` is set: its step and its link thread both stop (as a process
    frozen by the OS would), so the front end hears nothing from it and declares it dead. When it
    wakes, its held KV is poisoned (garbage blocks, a wrong t0): if D ever took it, the output could
    not match the reference."""
    runner, sender = proc.core.runner, proc.connector.sender
    execute, hold, heartbeat = runner.execute_model, sender.hold, proc.link.heartbeat

    def frozen_heartbeat():
        if state["stalled"] == proc.name:
            state["release"].wait(60)
        return heartbeat()

    def stalled_execute(sched):
        with state["lock"]:
            first = state["armed"] and state["stalled"] is None
            if first:
                state["stalled"] = proc.name
        if first:
            deadline = time.monotonic() + 10
            while not pulls(sender) and time.monotonic() < deadline:  # D's PullKV: pump our own port
                sender.poll()
                time.sleep(0.005)
            state["pulled"] = bool(pulls(sender))
            state["stalling"].set()
            state["release"].wait(60)
        return execute(sched)

    def poisoned_hold(req_id, block_ids, num_tokens, t0, transfer_id="", hidden=None, prefill_done_time=0.0):
        if state["stalled"] == proc.name:
            proc.core.runner.kv_cache[:, :, block_ids] = 1e3
            t0 = (t0 + 1) % VOCAB
        hold(req_id, block_ids, num_tokens, t0, transfer_id, hidden, prefill_done_time)

    runner.execute_model = stalled_execute
    sender.hold = poisoned_hold
    proc.link.heartbeat = frozen_heartbeat


def test_retry_race_decode_takes_only_the_retry(checkpoints, references, tmp_path):
    """P1 stalls past the front end's dead-after; the request is retried on P2 with the same D.
    D admits P2's KV and t0 only, P1's late header and error are dropped and counted, and every
    block of P1, P2 and D comes back."""
    model = str(checkpoints["qwen2"])
    engines = ThreadedEngines(tmp_path)
    common = dict(model=model, max_model_len=256, num_threads=1)
    state = {"lock": threading.Lock(), "armed": False, "stalled": None, "pulled": False, "stalling": threading.Event(),
             "release": threading.Event()}
    prefills = [engines.add("prefill", f"prefill-{i}", EngineConfig(**common)) for i in range(2)]
    decode = engines.add("decode", "decode-0", EngineConfig(**common))
    for p in prefills:
        install_stall(p, state)
    engines.start()
    client = client_for(engines.server_addr, model, "pd", 256, dead_after_s=1.0)
    prompt = random_prompts(1, 40, 40, VOCAB, 141)[0]
    try:
        with running_client(client) as run:
            run(wait_ready(client))
            # Warm both prefills up first (the first forward of a process loads kernels, which can
            # take longer than dead_after_s), so only the deliberate stall looks like a death.
            warm = run(generate_all(client, random_prompts(2, 8, 8, VOCAB, 140), GREEDY, timeout=60))
            assert all(r["error"] is None for r in warm), warm
            state["armed"] = True

            async def scenario():
                task = asyncio.ensure_future(generate_all(client, [prompt], GREEDY, timeout=60))
                (result,) = await task  # completes on the other P while the first one stalls
                return result

            result = run(scenario(), timeout=90)
            assert state["stalling"].is_set() and state["pulled"], "the first prefill never got D's pull"
            assert result["error"] is None, result
            assert references["qwen2"].assert_matches(prompt, result["tokens"], NEW, "retry race"), result
            stats = decode.connector.receiver.stats
            assert stats.dropped_unexpected == 0 and stats.transfers_received == 3  # 2 warm-ups + the retry
            state["release"].set()  # P1 wakes: sends its (poisoned) KV for the old attempt, then errors
            wait_until(lambda: stats.dropped_unexpected >= 1, 10, "D to drop P1's late messages")
            assert stats.transfers_received == 3 and stats.transfers_failed == 0
            run(wait_blocks_free(client, timeout=10))
            wait_until(lambda: all(not held(p.connector.sender) for p in prefills), 5, "no KV held on any P")
            wait_until(lambda: client.instances() and all(
                i.counters.get("kv_transfer_dropped_unexpected") == stats.dropped_unexpected
                for i in client.instances() if i.name == "decode-0"), 5, "the heartbeat to carry the counter")
            text = ServerMetrics(client.instances).render().decode()
            assert 'pdserve:kv_transfer_dropped_unexpected_total{instance="decode-0",role="decode"}' in text \
                or 'pdserve:kv_transfer_dropped_unexpected{instance="decode-0",role="decode"}' in text
    finally:
        state["release"].set()
        engines.stop()


def test_router_round_robin_is_per_role():
    """2 P, 1 D at equal load: prefills alternate (a shared counter advanced twice per request)."""
    client = RemoteEngineClient("ipc:///nowhere", "pd", 256, VOCAB, [1])
    now = time.monotonic()
    for name, role in (("p0", EngineRole.PREFILL), ("p1", EngineRole.PREFILL), ("d0", EngineRole.DECODE)):
        hb = em.Heartbeat(name, role, f"ipc://{name}", 10, 10, 0, 0, {})
        client.table[name] = Instance(name, role, hb, now, EngineState.READY)
    sent: list[tuple[str, object]] = []
    client._send = lambda name, message: sent.append((name, message))
    picked = []
    for i in range(6):
        tracked = Tracked(f"r{i}", [3, 4], GREEDY, asyncio.Queue())
        client._dispatch(tracked)
        picked.append(tracked.attempt.prefill)
        client._forget(tracked)  # done: equal load again
    assert sorted(picked) == ["p0"] * 3 + ["p1"] * 3 and picked[0] != picked[1], picked
    subs = [msg for _, msg in sent]
    assert all(s.transfer_id for s in subs)  # P and D get the attempt's transfer id
    assert len({s.transfer_id for s in subs}) == 6


def test_poisoned_cache_helper_is_what_it_claims():
    """Guard for the race test: writing 1e3 into blocks really changes them (no view/copy mistake)."""
    cache = torch.zeros(2, 2, 4, 16, 2, 8)
    cache[:, :, [1, 2]] = 1e3
    assert float(cache[:, :, 1].min()) == 1e3 and float(cache[:, :, 0].max()) == 0.0


def test_prefill_frees_an_old_attempt_as_soon_as_it_learns_of_the_new_one(tmp_path):
    """P holds attempt t1 of r (D asked for it); the front end retries r on the same P as t2: t1's
    blocks are freed at once and D hears a KVError for t1, while t2's pending pull is untouched."""
    import zmq

    from kv_transfer.receiver import KVReceiver
    from kv_transfer.sender import KVSender

    shape = (2, 2, 8, 4, 2, 8)
    ctx = zmq.Context()
    released: list[list[int]] = []
    sender = KVSender(ctx, f"ipc://{tmp_path}/p", torch.zeros(shape), "h", "{}", "prefill-0",
                      lambda _r, blocks: released.append(blocks))
    receiver = KVReceiver(ctx, torch.zeros(shape), "h", "{}", "decode-0")
    try:
        receiver.start("r", sender.address, [0, 1], "t1", 8)
        wait_until(lambda: (sender.poll(), receiver.poll(), ("r", "t1") in pulls(sender))[-1], 5, "t1's pull")
        sender.supersede("r", "t2")  # the retry's Submit reached P before t1 finished: only the pull to end
        assert ("r", "t1") not in pulls(sender) and ("r", "t1") in sender.ended
        failed = []
        wait_until(lambda: failed.extend(receiver.poll()[1]) or failed, 5, "D to hear t1 is over")
        assert failed[0].req_id == "r" and "superseded by a newer attempt" in failed[0].reason, failed
        sender.hold("r", [2, 3], 8, 5, "t1")   # t1's prefill finishing late is held under its own key...
        sender.supersede("r", "t2")           # ...and freed as soon as t2 is known
        assert released == [[2, 3]] and not held(sender)
    finally:
        sender.close()
        receiver.close()
        ctx.term()


def test_prefill_and_decode_are_chosen_independently_and_a_failing_pair_is_avoided():
    """2 P, 2 D at equal load: all four pairs carry traffic (not p0-d0 and p1-d1 forever); after 3
    failed transfers in a row between p0 and d0, p0 hands off to d1 only, and /metrics counts the trip."""
    client = RemoteEngineClient("ipc:///nowhere", "pd", 256, VOCAB, [1])
    now = time.monotonic()
    for name, role in (("p0", EngineRole.PREFILL), ("p1", EngineRole.PREFILL), ("d0", EngineRole.DECODE),
                       ("d1", EngineRole.DECODE)):
        hb = em.Heartbeat(name, role, f"ipc://{name}", 10, 10, 0, 0, {})
        client.table[name] = Instance(name, role, hb, now, EngineState.READY)
    client._send = lambda name, message: None

    def place(n: int) -> list[tuple[str, str]]:
        pairs = []
        for i in range(n):
            tracked = Tracked(f"r{i}", [3, 4], GREEDY, asyncio.Queue())
            client._dispatch(tracked)
            pairs.append((tracked.attempt.prefill, tracked.attempt.decode))
            client._forget(tracked)
        return pairs

    assert set(place(8)) == {("p0", "d0"), ("p0", "d1"), ("p1", "d0"), ("p1", "d1")}
    for _ in range(3):
        client.placement.transfer_failed("p0", "d0")
    assert client.counters()["pd_pair_breaker_trips_total"] == 1
    pairs = place(8)
    assert ("p0", "d0") not in pairs and ("p0", "d1") in pairs and ("p1", "d0") in pairs, pairs


def test_dead_and_departed_instances_leave_the_table_after_a_bound():
    """A dead or departed instance stays listed (so /status shows what happened) for `forget_after_s`,
    then goes; a live one stays whatever its age."""
    client = RemoteEngineClient("ipc:///nowhere", "pd", 256, VOCAB, [1], forget_after_s=60.0)
    now = time.monotonic()
    for name, state, since in (("p0", EngineState.DEAD, now - 61), ("p1", EngineState.DEAD, now - 30),
                               ("d0", EngineState.LEFT, now - 61), ("d1", EngineState.READY, now - 1000)):
        hb = em.Heartbeat(name, EngineRole.PREFILL, f"ipc://{name}", 10, 10, 0, 0, {})
        client.table[name] = Instance(name, EngineRole.PREFILL, hb, now, state, since)
    client._sweep(now)
    assert set(client.table) == {"p1", "d1"}
    assert {i.name: i.state for i in client.instances()} == {"p1": "dead", "d1": "ready"}
