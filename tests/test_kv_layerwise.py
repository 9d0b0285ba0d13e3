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
from pd_harness import ThreadedEngines, client_for, generate_all, running_client, wait_blocks_free, wait_ready

from engine.config import EngineConfig
from engine.types import KVTransferMode, SamplingParams
from kv_transfer import messages as m
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender, frames_checksum

VOCAB = 384
NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
SHAPE = (3, 2, 8, 4, 2, 8)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]


def run_pd(tmp_path, model: str, batches, mode: str, spec: str | None = "mtp", decode_kwargs=None, **prefill_kv):
    """Each batch of prompts runs after the previous one finished."""
    engines = ThreadedEngines(tmp_path)
    common = dict(model=model, max_model_len=320, num_threads=1, speculative_method=spec, num_speculative_tokens=1)
    prefill = engines.add("prefill", "prefill-0", EngineConfig(**common, max_num_batched_tokens=64),
                          kv_mode=mode, kv_checksum=True, **prefill_kv)
    decode = engines.add("decode", "decode-0", EngineConfig(**common, max_num_seqs=4), **(decode_kwargs or {}))
    engines.start()
    client = client_for(engines.server_addr, model, "pd", 320)
    try:
        with running_client(client) as run:
            run(wait_ready(client))
            results = [r for batch in batches for r in run(generate_all(client, batch, GREEDY, concurrency=4))]
            run(wait_blocks_free(client, timeout=10))
            hits = {"prefix_cache_hit_blocks": prefill.core.block_manager.num_hit_blocks}
            return results, {**prefill.connector.counters(), **hits}, decode.connector.counters()
    finally:
        engines.stop()


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
    engines = ThreadedEngines(tmp_path)
    cfg = dict(model=model, max_model_len=128, num_threads=1)
    prefill = engines.add("prefill", "prefill-0", EngineConfig(**cfg), kv_mode="layerwise", kv_lease_s=30.0)
    decode = engines.add("decode", "decode-0", EngineConfig(**cfg), kv_deadline_s=1.5)
    publish = prefill.connector.sender.publish_layer

    def first_layer_only(req_id, transfer_id, layer, *args, **kwargs):
        if layer == 0:
            publish(req_id, transfer_id, layer, *args, **kwargs)

    monkeypatch.setattr(prefill.connector.sender, "publish_layer", first_layer_only)
    engines.start()
    client = client_for(engines.server_addr, model, "pd", 128)
    try:
        with running_client(client) as run:
            run(wait_ready(client))
            results = run(generate_all(client, random_prompts(2, 20, 60, VOCAB, 154), GREEDY, timeout=60))
            assert all(r["finish_reason"] == "error" and "timed out" in r["error"] for r in results), results
            run(wait_blocks_free(client, timeout=10))
            assert not decode.connector.receiver.pulls and not prefill.connector.sender.held
            assert decode.connector.receiver.stats.layers_received > 0
    finally:
        engines.stop()


# -- the receiver alone, against a hand-driven prefill port ------------------------------------


class FakePrefill:
    """A ROUTER speaking P's side of the protocol by hand, to send anything in any order."""

    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr)
        self.peer: bytes | None = None

    def expect(self, kind: type, receiver: KVReceiver, timeout: float = 5.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            receiver.poll()
            if self.sock.poll(20):
                identity, payload = self.sock.recv_multipart()
                msg = m.decode(payload)
                if isinstance(msg, m.Hello):
                    self.peer = identity
                    self.sock.send_multipart([identity, m.encode(m.HelloAck("prefill-0"))])
                if isinstance(msg, kind):
                    return msg
        raise TimeoutError(f"no {kind.__name__} from the receiver")

    def send(self, *frames) -> None:
        self.sock.send_multipart([self.peer, *frames])


def layer_message(src: torch.Tensor, req: str, layer: int, start: int, end: int, n: int, checksum=True):
    blocks = torch.arange(src.shape[2])
    pos = torch.arange(start, end)
    slots = blocks[pos // SHAPE[3]] * SHAPE[3] + pos % SHAPE[3]
    kv = src[layer].reshape(2, -1, *SHAPE[4:]).index_select(1, slots).contiguous()
    frame = kv.numpy().tobytes()
    header = m.KVLayer(req, "t", "prefill-0", layer, start, end, n, "float32",
                       frames_checksum([frame]) if checksum else None)
    return [m.encode(header), frame]


def pump_until(receiver: KVReceiver, predicate, timeout: float = 5.0) -> tuple[list, list]:
    done, failed = [], []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        d, f = receiver.poll()
        done += d
        failed += f
        if predicate(done, failed):
            return done, failed
        time.sleep(0.01)
    raise TimeoutError("receiver did not get there")


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
        done, _ = pump_until(receiver, lambda d, f: d)
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
        _, failed = pump_until(receiver, lambda d, f: f)
        assert failed[0].req_id == "r2" and "truncated" in failed[0].reason
        assert fake.expect(m.Release, receiver).req_id == "r2"
        receiver.start("r3", f"ipc://{tmp_path}/p", [6, 7], "t", 5)
        fake.expect(m.PullKV, receiver)
        corrupt = layer_message(src, "r3", 2, 0, 5, 5)
        fake.send(corrupt[0], bytes(len(corrupt[1])))                  # right size, wrong bytes
        _, failed = pump_until(receiver, lambda d, f: f)
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
        pump_until(receiver, lambda d, f: (sender.poll(), receiver.stats.layers_received == 3)[-1])
        for layer in range(3):
            chunk(layer, 6, n)                           # chunk 2, on the route
        sender.hold("r", blocks, n, 9, "t")
        done, _ = pump_until(receiver, lambda d, f: (sender.poll(), d)[-1])
        assert done[0].t0 == 9 and receiver.stats.layers_received == 6
        assert torch.equal(dst[:, :, :2], src[:, :, :2]) and torch.equal(dst[:, :, 2, :2], src[:, :, 2, :2])
        wait = time.monotonic() + 5
        while not released and time.monotonic() < wait:  # D's ack frees P's blocks
            sender.poll()
            time.sleep(0.01)
        assert released == [blocks] and not sender.held and not sender.streams
    finally:
        sender.close()
        receiver.close()
        ctx.term()
