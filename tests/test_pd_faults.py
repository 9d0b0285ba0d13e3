"""PD failure modes, each bounded by a deadline and ending in a retry or a clear error (issue: PD)."""
from __future__ import annotations

import asyncio
import time

import pytest
import zmq
from conftest import make_checkpoint, random_prompts
from pd_harness import (
    ProcessGroup,
    ThreadedEngines,
    client_for,
    generate_all,
    running_client,
    wait_blocks_free,
    wait_ready,
    wait_until,
)

from engine.config import EngineConfig, KVTransferConfig
from engine.types import SamplingParams
from kv_transfer import messages as m

VOCAB = 384
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def counters(client, name: str) -> dict[str, float]:
    return next(i.counters for i in client.instances() if i.name == name)


def test_decode_dies_after_receiving_kv_prefill_frees_blocks_within_lease(checkpoints, tmp_path):
    """A fake D handshakes, pulls, takes the KV and vanishes without acking: P frees on lease expiry."""
    model = str(checkpoints["qwen2"])
    engines = ThreadedEngines(tmp_path)
    # The whole-transfer wire form, read by hand below (layer-wise: tests/test_kv_layerwise.py).
    prefill = engines.add("prefill", "prefill-0", EngineConfig(model=model, max_model_len=256),
                          KVTransferConfig(lease_s=1.5, mode="after-prefill"))
    engines.start()
    ctx = zmq.Context()
    front = ctx.socket(zmq.ROUTER)  # stands in for the front end
    front.bind(engines.server_addr)
    fake_d = ctx.socket(zmq.DEALER)
    fake_d.connect(prefill.connector.sender.address)
    fake_d.setsockopt(zmq.RCVTIMEO, 10000)
    try:
        fake_d.send(m.encode(m.Hello(prefill.connector.sender.compat_hash, "", "fake-decode")))
        assert isinstance(m.decode(fake_d.recv()), m.HelloAck)
        from engine import messages as em
        front.setsockopt(zmq.RCVTIMEO, 10000)
        front.recv_multipart()  # the first heartbeat: prefill-0 is connected
        front.send_multipart([b"prefill-0", em.encode(em.Submit("r1", random_prompts(1, 60, 60, VOCAB, 81)[0],
                                                                 {"max_tokens": 8, "temperature": 0.0}))])
        fake_d.send(m.encode(m.PullKV("r1")))
        frames = fake_d.recv_multipart()
        header = m.decode(frames[0])
        assert isinstance(header, m.KVHeader) and len(frames) == 1 + 2 * 2 * len(header.run_lengths)  # 2 layers, K+V
        fake_d.close(0)  # "killed": no ack, no keepalive
        core = prefill.core
        assert core.stats().kv_blocks_free < core.stats().kv_blocks_total  # held under the lease
        wait_until(lambda: core.stats().kv_blocks_free == core.stats().kv_blocks_total, 5,
                   "prefill to free the blocks after the lease expired")
        assert prefill.connector.sender.stats.leases_expired == 1
    finally:
        engines.stop()
        for s in (front, fake_d):
            s.close(0)
        ctx.term()


def test_decode_killed_under_load_no_hang_no_leak(checkpoints, tmp_path):
    model = str(checkpoints["qwen2"])
    group = ProcessGroup(tmp_path)
    group.add("prefill", "prefill-0", model, "--max-model-len", "256", "--kv-lease-s", "2")
    group.add("decode", "decode-0", model, "--max-model-len", "256", "--max-num-seqs", "4",
              env={"PDSERVE_DEBUG_STEP_DELAY": "0.02"})
    # With no decode left, failover waits resume_wait_s for one to come back, then fails clearly.
    client = client_for(group.server_addr, model, "pd", 256, dead_after_s=1.0, resume_wait_s=1.0)
    try:
        with running_client(client) as run:
            run(wait_ready(client))
            prompts = random_prompts(24, 50, 200, VOCAB, 82)
            params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

            async def scenario():
                task = asyncio.ensure_future(generate_all(client, prompts, params, concurrency=8, timeout=60))
                await asyncio.sleep(1.0)
                group.kill("decode-0")
                return await task

            results = run(scenario(), timeout=90)
            errors = [r for r in results if r["finish_reason"] == "error"]
            assert errors, "killing the only decode instance must fail its requests"
            assert all("died" in r["error"] or "no decode" in r["error"] for r in errors)
            # Prefill holds no blocks for the dead decode once leases run out.
            prefill = lambda: next(i for i in client.instances() if i.name == "prefill-0")  # noqa: E731
            wait_until(lambda: prefill().kv_blocks_free == prefill().kv_blocks_total, 8,
                       "the prefill instance to free every block")
    finally:
        group.stop()


@pytest.mark.parametrize("num_prefill", [2, 1])
def test_prefill_killed_mid_prefill(num_prefill, checkpoints, references, tmp_path):
    """With another P the request is retried there and completes exactly; with none it fails clearly."""
    model = str(checkpoints["qwen2"])
    group = ProcessGroup(tmp_path)
    for i in range(num_prefill):
        group.add("prefill", f"prefill-{i}", model, "--max-model-len", "256", "--max-num-batched-tokens", "16",
                  env={"PDSERVE_DEBUG_STEP_DELAY": "0.25"})
    group.add("decode", "decode-0", model, "--max-model-len", "256", "--kv-deadline-s", "20")
    client = client_for(group.server_addr, model, "pd", 256, dead_after_s=1.0, resume_wait_s=1.0)
    prompt = random_prompts(1, 200, 200, VOCAB, 83)[0]
    try:
        with running_client(client) as run:
            run(wait_ready(client))

            async def scenario():
                task = asyncio.ensure_future(generate_all(client, [prompt], GREEDY, timeout=60))
                await asyncio.sleep(1.0)  # 200 tokens at 16 per 0.25 s step: still prefilling
                victim = next(iter(client.tracked.values())).attempt.prefill
                group.kill(victim)
                return await task

            (result,) = run(scenario(), timeout=90)
            if num_prefill == 2:
                assert result["error"] is None, result
                references["qwen2"].assert_matches(prompt, result["tokens"], 16)
            else:
                assert result["finish_reason"] == "error" and "prefill" in result["error"], result
            decode = next(i for i in client.instances() if i.name == "decode-0")
            run(wait_blocks_free(client, timeout=5))
            assert decode.kv_blocks_total > 0
    finally:
        group.stop()


def test_garbage_frames_to_kv_port_are_dropped_and_counted(checkpoints, tmp_path):
    model = str(checkpoints["llama"])
    engines = ThreadedEngines(tmp_path)
    prefill = engines.add("prefill", "prefill-0", EngineConfig(model=model, max_model_len=256))
    engines.add("decode", "decode-0", EngineConfig(model=model, max_model_len=256))
    engines.start()
    client = client_for(engines.server_addr, model, "pd", 256)
    ctx = zmq.Context()
    attacker = ctx.socket(zmq.DEALER)
    attacker.connect(prefill.connector.sender.address)
    try:
        with running_client(client) as run:
            run(wait_ready(client))
            hello = m.encode(m.Hello(prefill.connector.sender.compat_hash, "", "x"))
            attacker.send(b"\x00\xffgarbage")                       # not msgpack
            attacker.send_multipart([b"a", b"b", b"c"])              # wrong frame count
            attacker.send(m.encode(m.PullKV("nobody")))              # no handshake: unauthenticated
            attacker.send(hello[: len(hello) // 2])                  # truncated
            attacker.send(m.encode(m.KVAck("r")) + b"trailing")      # trailing junk
            prompts = random_prompts(6, 10, 100, VOCAB, 84)
            results = run(generate_all(client, prompts, GREEDY))
            assert all(r["error"] is None for r in results)
            time.sleep(0.5)
            assert counters(client, "prefill-0")["kv_transfer_dropped_frames"] >= 5
            run(wait_blocks_free(client))
    finally:
        attacker.close(0)
        ctx.term()
        engines.stop()


def test_truncated_kv_payload_fails_clearly_and_frees(checkpoints, tmp_path):
    """A (fake) prefill answers with a header and short layer frames: D refuses, frees, and the
    request ends with a clear error after its retry."""
    model = str(checkpoints["qwen2"])
    engines = ThreadedEngines(tmp_path)
    decode = engines.add("decode", "decode-0", EngineConfig(model=model, max_model_len=256))
    engines.start()
    ctx = zmq.Context()
    fake_p = ctx.socket(zmq.ROUTER)
    kv_addr = f"ipc://{tmp_path}/fake-p-kv"
    fake_p.bind(kv_addr)
    from engine import messages as em
    heartbeat_out = ctx.socket(zmq.DEALER)  # the fake prefill's link to the front end
    heartbeat_out.setsockopt(zmq.IDENTITY, b"prefill-0")
    heartbeat_out.connect(engines.server_addr)
    client = client_for(engines.server_addr, model, "pd", 256)
    stop = False

    def fake_prefill():
        poller = zmq.Poller()
        poller.register(fake_p, zmq.POLLIN)
        while not stop:
            heartbeat_out.send(em.encode(em.Heartbeat("prefill-0", "prefill", kv_addr, 10, 10, 0, 0, {})))
            if not poller.poll(50):
                continue
            ident, payload = fake_p.recv_multipart()
            msg = m.decode(payload)
            if isinstance(msg, m.Hello):
                fake_p.send_multipart([ident, m.encode(m.HelloAck("prefill-0"))])
            elif isinstance(msg, m.PullKV):
                shape = list(decode.core.runner.kv_cache.shape[3:])
                header = m.KVHeader(msg.req_id, 5, 1, 7, [1], shape, "float32", msg.transfer_id, "prefill-0")
                fake_p.send_multipart([ident, m.encode(header), *[b"\x00" * 10] * 4])

    import threading
    t = threading.Thread(target=fake_prefill, daemon=True)
    t.start()
    try:
        with running_client(client) as run:
            run(wait_ready(client))
            (result,) = run(generate_all(client, [random_prompts(1, 5, 5, VOCAB, 85)[0]], GREEDY, timeout=30))
            assert result["finish_reason"] == "error" and "truncated" in result["error"]
            assert decode.connector.receiver.stats.transfers_failed == 2  # first try and the retry
            core = decode.core
            wait_until(lambda: core.stats().kv_blocks_free == core.stats().kv_blocks_total, 3,
                       "decode to free the reserved blocks")
    finally:
        stop = True
        t.join(2)
        engines.stop()
        for s in (fake_p, heartbeat_out):
            s.close(0)
        ctx.term()


def test_peer_with_different_model_refused_at_handshake(checkpoints, tmp_path):
    model_a = str(checkpoints["qwen2"])
    model_b = str(make_checkpoint("qwen2", tmp_path / "other", seed=5))  # same shapes, other weights
    engines = ThreadedEngines(tmp_path)
    prefill = engines.add("prefill", "prefill-0", EngineConfig(model=model_a, max_model_len=256))
    engines.add("decode", "decode-0", EngineConfig(model=model_b, max_model_len=256))
    engines.start()
    client = client_for(engines.server_addr, model_a, "pd", 256)
    try:
        with running_client(client) as run:
            run(wait_ready(client))
            (result,) = run(generate_all(client, [[3, 4, 5, 6]], GREEDY, timeout=30))
            assert result["finish_reason"] == "error"
            assert "incompatible KV layout" in result["error"] and "weights" in result["error"]
            assert prefill.connector.sender.stats.handshakes_rejected >= 1
            run(wait_blocks_free(client))
    finally:
        engines.stop()
