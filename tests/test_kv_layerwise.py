"""Layer-wise KV push (issue 15, part 2): P sends each layer's KV of each chunk as its forward
writes it, D admits once every layer (target and MTP) covers the prompt. Exactness against
transformers in both transfer modes, with MTP, chunked prefill and a prefix-cache hit on P; a
partial stream ends in the failure path with every block back; layers may arrive in any order;
bad frames are rejected and the loop goes on."""
from __future__ import annotations

import random
import time

import pytest
import torch
import zmq
from conftest import random_prompts
from kv_harness import VOCAB, FakePrefill, greedy, held, kv_shape, layer_message, pd_pair, pulls, pump, streaming
from pd_harness import ThreadedEngines, generate_all, wait_blocks_free, wait_until

from engine import messages as em
from engine.config import EngineConfig, KVTransferConfig
from engine.types import KVTransferMode, SamplingParams
from kv_transfer import messages as m
from kv_transfer.layer_stream import LayerStreamer
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender

NEW = 12
GREEDY = greedy(NEW)
SHAPE = kv_shape(3)  # a middle layer too


def run_pd(tmp_path, model: str, batches, mode: str, spec: str | None = "mtp", decode_kv=None, prefill_hook=None,
           **prefill_kv):
    """Each batch of prompts runs after the previous one finished; `prefill_hook(prefill)` runs
    before the engines start; `prefill_kv`: KVTransferConfig fields of P beyond the mode."""
    spec_config = dict(speculative_method=spec, num_speculative_tokens=1)
    with pd_pair(tmp_path, model, 320, prefill=dict(spec_config, max_num_batched_tokens=64),
                 decode=dict(spec_config, max_num_seqs=4), decode_kv=decode_kv,
                 prefill_kv=KVTransferConfig(mode=mode, checksum=True, **{"layerwise_min_tokens": 0, **prefill_kv}),
                 before_start=None if prefill_hook is None else lambda prefill, _decode: prefill_hook(prefill)) as pd:
        run, client, prefill = pd.run, pd.client, pd.prefill
        results = [r for batch in batches for r in run(generate_all(client, batch, GREEDY, concurrency=4))]
        run(wait_blocks_free(client, timeout=10))
        assert_nothing_left(prefill)
        hits = {"prefix_cache_hit_blocks": prefill.core.block_manager.num_hit_blocks}
        return results, {**prefill.connector.counters(), **hits}, pd.decode.connector.counters()


def assert_nothing_left(prefill) -> None:
    """Every transfer's state on P is gone once its blocks are: no per-request leak anywhere."""
    sender = prefill.connector.sender
    assert not prefill.connector.handoffs and not prefill.core.runner.kv_tap.reported
    assert not sender.transfers
    if sender.streamer is not None:  # the stream thread's own tables (it forgets on the engine's word)
        wait_until(lambda: not (sender.streamer.routes or sender.streamer.waiting), 5, "the stream to forget")


@pytest.mark.parametrize("mode", list(KVTransferMode))
def test_pd_equals_transformers_in_both_modes_with_mtp_chunks_and_prefix_hits(mode, mtp_checkpoints, references,
                                                                              tmp_path):
    rest = random_prompts(6, 1, 250, VOCAB, 151)
    shared = random_prompts(1, 80, 80, VOCAB, 152)[0]
    # The second of two prompts with a common 80-token prefix hits P's prefix cache: those
    # positions are never computed there, yet their KV (every layer) must reach D.
    prompts = [shared + [5, 6, 7], shared + [9, 10, 11, 12], *rest]
    results, p_counters, d_counters = run_pd(tmp_path, str(mtp_checkpoints["qwen2"]), [prompts[:1], prompts[1:]],
                                             mode)
    assert p_counters["prefix_cache_hit_blocks"] >= 4
    for i, (p, r) in enumerate(zip(prompts, results)):
        assert r["error"] is None and r["finish_reason"] == "length", r
        references["qwen2"].assert_matches(p, r["tokens"], NEW, f"{mode}/prompt {i}")
    assert d_counters["kv_transfer_transfers_received"] == len(prompts)
    assert d_counters["kv_transfer_handoff_seconds_count"] == len(prompts)  # P's last layer -> D's first step
    if mode == KVTransferMode.LAYERWISE:
        # 5 KV layers (4 target + MTP); the longest prompts take several 64-token chunks.
        assert p_counters["kv_transfer_layers_sent"] == d_counters["kv_transfer_layers_received"]
        assert d_counters["kv_transfer_layers_received"] > 5 * len(prompts)
    else:
        assert d_counters["kv_transfer_layers_received"] == 0


@pytest.mark.parametrize("mode", list(KVTransferMode))
def test_prompt_cached_but_its_last_token_still_gets_its_mtp_layer_when_p_drafts_nothing(mode, mtp_checkpoints,
                                                                                         references, tmp_path):
    """A prompt whose prefix-cache hit on P covers all but its last token starts on P as a decode
    row (one position to compute). When P's speculation policy chose k=0 the MTP layer used to
    skip that row, so the MTP KV of the prompt's last position was never written: in layer-wise
    mode D waited out its deadline for the MTP layer, in after-prefill mode it got a stale one."""
    prompt = random_prompts(1, 4 * 16 + 1, 4 * 16 + 1, VOCAB, 154)[0]  # 4 full blocks + 1 token

    def no_drafts_on_p(prefill):
        prefill.core.runner.spec_policy.choose = lambda batch_size, pending=0, sampled=False: 0

    results, p_counters, d_counters = run_pd(tmp_path, str(mtp_checkpoints["qwen2"]), [[prompt], [prompt]], mode,
                                             decode_kv=KVTransferConfig(deadline_s=5.0), prefill_hook=no_drafts_on_p)
    assert p_counters["prefix_cache_hit_blocks"] >= 4
    for r in results:
        assert r["error"] is None and r["finish_reason"] == "length", r
        references["qwen2"].assert_matches(prompt, r["tokens"], NEW, f"{mode}/cached prompt")
    # Both modes: each request's one transfer landed (no deadline, no resume), and the MTP pass over
    # the prompt's last position ran on P (its end starts the hand-off clock).
    assert d_counters["kv_transfer_transfers_received"] == 2 and d_counters["kv_transfer_transfers_failed"] == 0
    assert d_counters["kv_transfer_handoff_seconds_count"] == 2
    if mode == KVTransferMode.LAYERWISE:
        assert p_counters["kv_transfer_layers_sent"] == d_counters["kv_transfer_layers_received"]


def test_prompts_below_the_layerwise_threshold_go_whole(mtp_checkpoints, references, tmp_path):
    """--kv-layerwise-min-tokens: a short prompt's KV goes in one message after its prefill (a layer
    snapshot costs more than it saves there), a long one's layer by layer; both exact."""
    short, long_ = random_prompts(1, 40, 40, VOCAB, 155)[0], random_prompts(1, 200, 200, VOCAB, 156)[0]
    results, p_counters, d_counters = run_pd(tmp_path, str(mtp_checkpoints["qwen2"]), [[short], [long_]],
                                             KVTransferMode.LAYERWISE, layerwise_min_tokens=100)
    for p, r in zip((short, long_), results):
        assert r["error"] is None, r
        references["qwen2"].assert_matches(p, r["tokens"], NEW, f"{len(p)} tokens")
    assert d_counters["kv_transfer_transfers_received"] == 2
    # Only the long prompt streamed: its 2 target KV layers x four 64-token chunks (P runs no MTP
    # layer: the prompt's last hidden states come with the done message instead).
    assert p_counters["kv_transfer_layers_sent"] == d_counters["kv_transfer_layers_received"] == 2 * 4


def test_layerwise_without_mtp_and_tiny_chunks(checkpoints, references, tmp_path):
    prompts = random_prompts(3, 30, 120, VOCAB, 153)
    results, _, d_counters = run_pd(tmp_path, str(checkpoints["llama"]), [prompts], KVTransferMode.LAYERWISE, spec=None)
    for i, (p, r) in enumerate(zip(prompts, results)):
        assert r["error"] is None, r
        references["llama"].assert_matches(p, r["tokens"], NEW, f"no-mtp/prompt {i}")
    assert d_counters["kv_transfer_layers_received"] >= 2 * 3  # 2 layers, at least one chunk each


def test_partial_stream_ends_in_the_failure_path_with_every_block_back(checkpoints, tmp_path, monkeypatch):
    """P streams only layer 0: D never sees the transfer complete, gives up at its deadline, tells
    P to release; the client gets a clear error and no block stays taken on either side."""
    model = str(checkpoints["qwen2"])

    def first_layer_only(prefill, _decode):
        publish = prefill.connector.sender.publish_layer

        def publish_layer_0(req_id, transfer_id, layer, *args, **kwargs):
            if layer == 0:
                publish(req_id, transfer_id, layer, *args, **kwargs)

        monkeypatch.setattr(prefill.connector.sender, "publish_layer", publish_layer_0)

    with pd_pair(tmp_path, model, 128,
                 prefill_kv=KVTransferConfig(mode="layerwise", layerwise_min_tokens=0, lease_s=30.0),
                 decode_kv=KVTransferConfig(deadline_s=1.5), before_start=first_layer_only) as pd:
        run, client, prefill, decode = pd.run, pd.client, pd.prefill, pd.decode
        results = run(generate_all(client, random_prompts(2, 20, 60, VOCAB, 154), GREEDY, timeout=60))
        assert all(r["finish_reason"] == "error" and "timed out" in r["error"] for r in results), results
        run(wait_blocks_free(client, timeout=10))
        assert not decode.connector.receiver.pulls and not held(prefill.connector.sender)
        assert decode.connector.receiver.stats.layers_received > 0


def test_a_layer_corrupted_on_the_wire_is_caught_before_admission(checkpoints, references, tmp_path, monkeypatch):
    """One bit of one layer frame flipped after P computed its checksum: D refuses the transfer,
    the front end re-prefills (or fails clearly), later requests are exact, no block is left."""
    real = LayerStreamer._send_frames
    flipped = {"n": 0}

    def flip_first_layer_frame(self, frames):
        if flipped["n"] == 0 and len(frames) == 3:
            bad = bytearray(frames[2])
            bad[len(bad) // 2] ^= 0x10
            frames = [*frames[:2], bytes(bad)]
            flipped["n"] += 1
        real(self, frames)

    monkeypatch.setattr(LayerStreamer, "_send_frames", flip_first_layer_frame)
    model = str(checkpoints["qwen2"])
    prompts = random_prompts(3, 20, 60, VOCAB, 155)
    with pd_pair(tmp_path, model, 128,
                 prefill_kv=KVTransferConfig(mode="layerwise", layerwise_min_tokens=0, checksum=True)) as pd:
        run, client = pd.run, pd.client
        results = run(generate_all(client, prompts, GREEDY, concurrency=1, timeout=60))
        assert flipped["n"] == 1 and pd.decode.connector.receiver.stats.checksum_mismatches == 1
        for p, r in zip(prompts, results):
            if r["error"] is None:
                references["qwen2"].assert_matches(p, r["tokens"], NEW)
            else:
                assert "checksum mismatch" in r["error"], r
        assert sum(r["error"] is None for r in results) >= 2
        run(wait_blocks_free(client, timeout=10))


def test_decode_vanishing_mid_stream_leaves_nothing_held_on_prefill(checkpoints, tmp_path):
    """A fake D pulls, takes the layers and the done message, and vanishes without acking: P's
    stream thread has sent everything it had, and P frees the blocks when the lease expires."""
    model = str(checkpoints["qwen2"])
    engines = ThreadedEngines(tmp_path)
    prefill = engines.add("prefill", "prefill-0", EngineConfig(model=model, max_model_len=256,
                                                               max_num_batched_tokens=32),
                          KVTransferConfig(lease_s=1.5, mode="layerwise", layerwise_min_tokens=0))
    engines.start()
    ctx = zmq.Context()
    front = ctx.socket(zmq.ROUTER)  # stands in for the front end
    front.bind(engines.server_addr)
    fake_d = ctx.socket(zmq.DEALER)
    fake_d.connect(prefill.connector.sender.address)
    for s in (front, fake_d):
        s.setsockopt(zmq.RCVTIMEO, 10000)
    try:
        fake_d.send(m.encode(m.Hello(prefill.connector.sender.compat_hash, "", "fake-decode")))
        assert isinstance(m.decode(fake_d.recv()), m.HelloAck)
        front.recv_multipart()  # the first heartbeat: prefill-0 is connected
        fake_d.send(m.encode(m.PullKV("r1", "t1")))  # before P even has the request: the route is known early
        prompt = random_prompts(1, 70, 70, VOCAB, 156)[0]
        front.send_multipart([b"prefill-0", em.encode(em.Submit("r1", prompt, SamplingParams(max_tokens=8),
                                                                 transfer_id="t1"))])
        spans = []
        while True:
            frames = fake_d.recv_multipart()
            msg = m.decode(frames[0])
            if isinstance(msg, m.KVLayersDone):
                break
            assert isinstance(msg, m.KVLayer) and len(frames) == 2
            spans.append((msg.layer, msg.start, msg.end))
        assert msg.num_tokens == 70 and msg.num_layers == 2
        # 32-token chunks: each of the 2 layers came as [0, 32), [32, 64), [64, 70), in order.
        assert spans == [(layer, a, b) for a, b in ((0, 32), (32, 64), (64, 70)) for layer in (0, 1)]
        fake_d.close(0)  # "killed": no ack, no keepalive
        core = prefill.core
        assert core.stats().kv_blocks_free < core.stats().kv_blocks_total  # held under the lease
        wait_until(lambda: core.stats().kv_blocks_free == core.stats().kv_blocks_total, 5,
                   "prefill to free the blocks after the lease expired")
        assert prefill.connector.sender.stats.leases_expired == 1 and not streaming(prefill.connector.sender)
    finally:
        engines.stop()
        for s in (front, fake_d):
            s.close(0)
        ctx.term()


# -- the receiver alone, against a hand-driven prefill port ------------------------------------


def test_layers_in_any_order_and_bad_frames_rejected_without_ending_the_loop(tmp_path):
    ctx = zmq.Context()
    fake = FakePrefill(ctx, f"ipc://{tmp_path}/p")
    src = torch.randn(SHAPE)
    dst = torch.zeros(SHAPE)
    receiver = KVReceiver(ctx, dst, "h", "{}", "decode-0", deadline_s=30.0, vocab_size=100)
    n = 22  # 6 blocks of 4: the last one partly used
    try:
        receiver.start("r1", f"ipc://{tmp_path}/p", list(range(6)), "t", n)
        fake.expect(m.PullKV, receiver)
        # Done first, then the layers shuffled, in two chunks, one of them sent twice; junk in between.
        pieces = [layer_message(src, "r1", layer, a, b, n) for layer in range(3) for a, b in ((0, 9), (9, n))]
        pieces.append(layer_message(src, "r1", 1, 3, 12, n))  # an overlapping repeat is harmless
        random.Random(5).shuffle(pieces)
        fake.send(m.encode(m.KVLayersDone("r1", "t", "prefill-0", n, 3, 7)))
        fake.send(b"\xc1 not msgpack")                                 # malformed: dropped
        fake.send(*layer_message(src, "other", 0, 0, 4, n))            # a transfer nobody expects: dropped
        for piece in pieces:
            fake.send(*piece)
        done, _ = pump(receiver, until=lambda d, f: d)
        assert [(c.req_id, c.t0, c.num_tokens) for c in done] == [("r1", 7, n)]
        flat = dst.view(3, 2, -1, *SHAPE[4:])
        assert torch.equal(flat[:, :, :n], src.view(3, 2, -1, *SHAPE[4:])[:, :, :n])
        assert receiver.stats.dropped_frames >= 1 and receiver.stats.dropped_unexpected >= 1
        assert fake.expect(m.KVAck, receiver).req_id == "r1"

        # The expected transfer sends a frame that does not fit: it fails (retryable), nothing lands.
        receiver.start("r2", f"ipc://{tmp_path}/p", [6, 7], "t", 5)
        fake.expect(m.PullKV, receiver)
        bad = layer_message(src, "r2", 0, 0, 5, 5)
        fake.send(bad[0], bad[1][:-4])                                 # truncated
        _, failed = pump(receiver, until=lambda d, f: f)
        assert failed[0].req_id == "r2" and "truncated" in failed[0].reason
        assert fake.expect(m.Release, receiver).req_id == "r2"
        receiver.start("r3", f"ipc://{tmp_path}/p", [6, 7], "t", 5)
        fake.expect(m.PullKV, receiver)
        corrupt = layer_message(src, "r3", 2, 0, 5, 5)
        fake.send(corrupt[0], bytes(len(corrupt[1])))                  # right size, wrong bytes
        _, failed = pump(receiver, until=lambda d, f: f)
        assert "checksum" in failed[0].reason and receiver.stats.checksum_mismatches == 1
        assert not receiver.pulls
    finally:
        receiver.close()
        fake.sock.close(0)
        ctx.term()


def test_sender_streams_layers_queued_before_and_after_the_pull(tmp_path):
    """Layers published before D's pull wait in the stream thread; the rest go as they come; the
    done message follows them; D's ack frees P's blocks."""
    ctx = zmq.Context()
    src = torch.randn(SHAPE)
    dst = torch.zeros(SHAPE)
    released = []
    sender = KVSender(ctx, f"ipc://{tmp_path}/p", src, "h", "{}", "prefill-0", lambda _r, b: released.append(b),
                      layerwise=True, checksum=True)
    receiver = KVReceiver(ctx, dst, "h", "{}", "decode-0", deadline_s=30.0)
    n, blocks = 10, [0, 1, 2]

    def chunk(layer: int, a: int, b: int) -> None:
        sender.publish_layer("r", "t", layer, a, b, n, src[layer].reshape(2, -1, *SHAPE[4:])[:, a:b].clone())

    try:
        for layer in range(3):
            chunk(layer, 0, 6)                           # chunk 1, before anyone asked
        receiver.start("r", sender.address, blocks, "t", n)
        pump(receiver, until=lambda d, f: (sender.poll(), receiver.stats.layers_received == 3)[-1])
        for layer in range(3):
            chunk(layer, 6, n)                           # chunk 2, on the route
        sender.hold("r", blocks, n, 9, "t")
        done, _ = pump(receiver, until=lambda d, f: (sender.poll(), d)[-1])
        assert done[0].t0 == 9 and receiver.stats.layers_received == 6
        assert torch.equal(dst[:, :, :2], src[:, :, :2]) and torch.equal(dst[:, :, 2, :2], src[:, :, 2, :2])
        wait = time.monotonic() + 5
        while not released and time.monotonic() < wait:  # D's ack frees P's blocks
            sender.poll()
            time.sleep(0.01)
        assert released == [blocks] and not held(sender) and not streaming(sender)
    finally:
        sender.close()
        receiver.close()
        ctx.term()


def test_a_pull_from_a_new_connection_gets_the_whole_transfer_and_p_death_ends_in_the_deadline(tmp_path):
    """The stream went to D's first connection; D re-handshaked (a new connection) and pulls
    again: P answers with the whole-transfer form, which D takes for any pull. Then P dies in
    the middle of another stream: D's deadline ends the pull, nothing of it stays."""
    ctx = zmq.Context()
    src = torch.randn(SHAPE)
    dst = torch.zeros(SHAPE)
    sender = KVSender(ctx, f"ipc://{tmp_path}/p", src, "h", "{}", "prefill-0", lambda *_: None, layerwise=True)
    first = KVReceiver(ctx, torch.zeros(SHAPE), "h", "{}", "decode-0", deadline_s=30.0)
    second = KVReceiver(ctx, dst, "h", "{}", "decode-0", deadline_s=1.0)
    n, blocks = 8, [0, 1]
    try:
        first.start("r", sender.address, blocks, "t", n)
        pump(first, until=lambda d, f: (sender.poll(), ("r", "t") in pulls(sender))[-1])
        sender.publish_layer("r", "t", 0, 0, n, n, src[0].reshape(2, -1, *SHAPE[4:])[:, :n].clone())
        pump(first, until=lambda d, f: first.stats.layers_received == 1)
        second.start("r", sender.address, blocks, "t", n)  # the same transfer, from a new connection
        pump(second, until=lambda d, f: (sender.poll(), ("r", "t") in pulls(sender))[-1] and
                   pulls(sender)[("r", "t")].requester != sender.transfers[("r", "t")].first_puller)
        sender.hold("r", blocks, n, 4, "t")
        done, _ = pump(second, until=lambda d, f: (sender.poll(), d)[-1])
        assert done[0].t0 == 4 and second.stats.layers_received == 0  # the whole transfer, in one message
        assert torch.equal(dst[:, :, :2], src[:, :, :2])

        second.start("r2", sender.address, [2, 3], "t", n)
        pump(second, until=lambda d, f: (sender.poll(), ("r2", "t") in pulls(sender))[-1])
        sender.publish_layer("r2", "t", 0, 0, 4, n, src[0].reshape(2, -1, *SHAPE[4:])[:, :4].clone())
        pump(second, until=lambda d, f: second.stats.layers_received == 1)
        sender.close()  # P dies with the stream half sent
        sender = None
        _, failed = pump(second, until=lambda d, f: f, timeout=5)
        assert failed[0].req_id == "r2" and "timed out" in failed[0].reason and not second.pulls
    finally:
        for r in (first, second):
            r.close()
        if sender is not None:
            sender.close()
        ctx.term()


@pytest.mark.parametrize("layerwise", [False, True])
def test_hidden_states_stand_in_for_the_mtp_layers_kv(layerwise, tmp_path):
    """A prefill engine that hands over hidden states (windowed MTP) sends the target layers' KV and
    the hidden states, not the MTP layer's KV: D lands the first, keeps the second for its drafter
    and leaves the MTP layer's blocks alone. Hidden states of the wrong size fail the transfer with
    a clear reason, before anything is written."""
    ctx = zmq.Context()
    src = torch.randn(SHAPE)
    hidden = torch.randn(3, 16)
    n, blocks = 10, [0, 1, 2]
    sender = KVSender(ctx, f"ipc://{tmp_path}/p", src, "h", "{}", "prefill-0", lambda *_: None,
                      layerwise=layerwise, checksum=True, draft_layers=1)
    receivers = {size: KVReceiver(ctx, torch.zeros(SHAPE), "h", "{}", f"decode-{size}", deadline_s=30.0,
                                  draft_layers=1, hidden_size=size) for size in (16, 12)}
    try:
        for size, (req_id, receiver) in zip((16, 12), (("r1", receivers[16]), ("r2", receivers[12]))):
            if layerwise:
                for layer in range(2):  # the target's layers only: P ran no MTP layer
                    kv = src[layer].reshape(2, -1, *SHAPE[4:])[:, :n].clone()
                    sender.publish_layer(req_id, "t", layer, 0, n, n, kv)
            receiver.start(req_id, sender.address, blocks, "t", n)
            sender.hold(req_id, blocks, n, 9, "t", hidden)
            done, failed = pump(receiver, until=lambda d, f: (sender.poll(), d or f)[-1])
            dst = receiver.kv_cache
            if size == 16:
                assert not failed and torch.equal(done[0].hidden, hidden) and done[0].t0 == 9
                assert torch.equal(dst[:2, :, :2], src[:2, :, :2]) and torch.equal(dst[:2, :, 2, :2], src[:2, :, 2, :2])
                assert not dst[2].any()  # the MTP layer's blocks: not sent, not written
            else:
                assert not done and "hidden states" in failed[0].reason, failed
                if not layerwise:  # (a stream's layers land as they come; a whole transfer is checked first)
                    assert not dst.any()
    finally:
        sender.close()
        for receiver in receivers.values():
            receiver.close()
        ctx.term()
