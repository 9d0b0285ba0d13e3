"""Hostile KV traffic (issue 14, hole 3): nothing a peer sends can end an engine loop, write into
KV memory it should not, or leak a block, and every hostile message is accounted for.

A fake prefill instance (an in-process ROUTER) becomes a peer of a real decode engine by way of
decoy requests that name it as their KV source; it then sends more than 10,000 hostile messages
to the decode engine while real requests run through a real prefill engine. The same hostile
messages go to the real prefill engine's KV port too."""
from __future__ import annotations

import random
import threading
import time
import uuid

import msgspec
import zmq
from conftest import random_prompts
from kv_harness import VOCAB, greedy, held, pd_pair, pulls
from pd_harness import generate_all, wait_blocks_free, wait_until

from engine import messages as em
from kv_transfer import messages as m

NEW = 12
GREEDY = greedy(NEW)
DECOY_LEN = 20  # prompt tokens of a decoy: 2 blocks of 16
BATCH = 400     # hostile messages in flight at once (below ZMQ's default high-water mark of 1000)


class Fuzzer:
    """Builds hostile messages, each a list of frames, and the counter it must land in on D."""

    def __init__(self, rng: random.Random, shape: list[int], decoys: dict[str, str]) -> None:
        self.rng, self.decoys = rng, decoys
        self.layers, self.block_shape = shape[0], list(shape[3:])
        self.block_bytes = 4 * self.block_shape[0] * self.block_shape[1] * self.block_shape[2]

    def header(self, req_id: str, tid: str, sender: str = "fake-p", **changes) -> m.KVHeader:
        fields = dict(req_id=req_id, num_tokens=DECOY_LEN, num_blocks=2, t0=5, run_lengths=[2],
                      block_shape=self.block_shape, dtype="float32", transfer_id=tid, sender=sender)
        return m.KVHeader(**{**fields, **changes})

    def frames(self, runs: list[int]) -> list[bytes]:
        return [bytes(self.block_bytes * n) for _ in range(self.layers * 2) for n in runs]

    def random_header(self, req_id: str, tid: str, sender: str = "fake-p") -> list[bytes]:
        r = self.rng
        changes = r.choice([{}, {"num_tokens": r.choice([-1, 0, 10**12, 2**63 - 1])},
                            {"num_blocks": r.choice([-3, 0, 1, 10**9])}, {"t0": r.choice([-7, VOCAB, 2**62])},
                            {"run_lengths": r.choice([[], [0], [-1, 3], [1] * 64])},
                            {"block_shape": [1, 2, 3]}, {"dtype": "int8"}, {"checksum": r.randrange(2**64)}])
        return [m.encode(self.header(req_id, tid, sender, **changes)), *self.frames([2])[: r.randrange(6)]]

    def malformed(self) -> list[bytes]:
        """Dropped as undecodable (counted in dropped_frames)."""
        r = self.rng
        valid = m.encode(self.header("x" * r.randrange(1, 40), "t"))
        return r.choice([
            lambda: [r.randbytes(r.randrange(0, 200))],                         # random bytes
            lambda: [valid[: r.randrange(1, len(valid))]],                      # truncated
            lambda: [valid + b"\x00junk"],                                      # trailing bytes
            lambda: [r.randbytes(r.randrange(1, 64)) for _ in range(r.randrange(2, 6))],  # frames, no header
            lambda: [r.randbytes(1 << 18)],                                     # oversized
            lambda: [m.encode(m.HelloAck("fake-p")), b"extra"],                 # control message + frames
        ])()

    def unexpected(self) -> list[bytes]:
        """Well-formed, for a transfer D does not expect (counted in dropped_unexpected)."""
        r = self.rng
        req, tid = r.choice(list(self.decoys.items()))
        return r.choice([
            lambda: self.random_header(uuid.uuid4().hex, "t"),                  # unknown request
            lambda: self.random_header(req, tid + "-old"),                      # an older attempt
            lambda: self.random_header(req, tid, sender="someone-else"),        # another P's name
            lambda: [m.encode(m.KVError(r.choice([req, "nobody"]), "no", "other"))],
            lambda: [m.encode(r.choice([m.PullKV(req, tid), m.KVAck(req), m.KeepAlive([req]),
                                        m.Release(req, "x"), m.Hello("h", "{}", "p")]))],  # wrong direction
            lambda: [m.encode(r.choice([m.HelloAck("again"), m.HelloReject("late")]))],     # handshake over
        ])()

    def invalid_for(self, req: str, tid: str, i: int) -> list[bytes]:
        """The expected transfer with one field (or frame) wrong: fails it (transfers_invalid)."""
        bad_fields = [{"num_tokens": 10**12}, {"num_tokens": -5}, {"num_tokens": DECOY_LEN - 1}, {"num_tokens": 0},
                      {"num_blocks": 0}, {"num_blocks": 1}, {"num_blocks": 10**9}, {"num_blocks": -1},
                      {"t0": -7}, {"t0": VOCAB}, {"t0": 2**62}, {"run_lengths": []}, {"run_lengths": [0, 2]},
                      {"run_lengths": [1]}, {"run_lengths": [3]}, {"run_lengths": [-1, 3]},
                      {"block_shape": [1, 1, 1]}, {"dtype": "bfloat16"}, {"checksum": 12345}]
        frames = self.frames([2])
        bad_frames = [frames[:-1], frames + [frames[0]], [frames[0][:-1], *frames[1:]],
                      [frames[0] + bytes(1 << 20), *frames[1:]], []]
        if i < len(bad_fields):
            return [m.encode(self.header(req, tid, **bad_fields[i])), *frames]
        return [m.encode(self.header(req, tid)), *bad_frames[i - len(bad_fields)]]

    NUM_INVALID = 19 + 5


def pump(sock: zmq.Socket, until, timeout: float, what: str) -> list[tuple[bytes, m.Message]]:
    """Receive on the fake prefill's ROUTER until `until(received)`; returns what came."""
    got: list[tuple[bytes, m.Message]] = []
    deadline = time.monotonic() + timeout
    while not until(got):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if sock.poll(20):
            ident, payload = sock.recv_multipart()[:2]
            try:
                msg = m.decode(payload)
            except msgspec.DecodeError:
                continue
            if isinstance(msg, m.Hello):
                sock.send_multipart([ident, m.encode(m.HelloAck("fake-p"))])
            got.append((ident, msg))
    return got


def test_fuzz_decode_and_prefill_kv_ports(checkpoints, references, tmp_path):
    model = str(checkpoints["qwen2"])
    ctx = zmq.Context()
    fake_p = ctx.socket(zmq.ROUTER)
    fake_p.setsockopt(zmq.LINGER, 0)
    fake_addr = f"ipc://{tmp_path}/fake-p-kv"
    fake_p.bind(fake_addr)
    rng = random.Random(14)
    decoys = {f"decoy-{i}": uuid.uuid4().hex[:16] for i in range(Fuzzer.NUM_INVALID)}
    prompts = random_prompts(12, 5, 120, VOCAB, 142)
    results: list = []
    try:
        with pd_pair(tmp_path, model, 256, decode=dict(max_num_seqs=8)) as pd:
            run, client, prefill, decode, engines = pd.run, pd.client, pd.prefill, pd.decode, pd.engines
            fuzz = Fuzzer(rng, list(decode.core.runner.kv_cache.shape), decoys)
            stats = decode.connector.receiver.stats

            async def submit_decoys():
                for req, tid in decoys.items():
                    client._send("decode-0", em.Submit(req, [7] * DECOY_LEN, GREEDY, fake_addr, tid))

            run(submit_decoys())
            got = pump(fake_p, lambda g: sum(isinstance(x, m.PullKV) for _, x in g) >= len(decoys), 20,
                       "the decoys' pulls")
            hello = next(ident for ident, x in got if isinstance(x, m.Hello))
            real = threading.Thread(target=lambda: results.extend(run(generate_all(client, prompts, GREEDY))))
            real.start()
            sent = {"frames": 0, "unexpected": 0}
            for batch in range(26):  # 26 x 400 = 10,400 hostile messages
                for _ in range(BATCH):
                    kind = "frames" if rng.random() < 0.5 else "unexpected"
                    msg = fuzz.malformed() if kind == "frames" else fuzz.unexpected()
                    fake_p.send_multipart([hello, *msg])
                    sent[kind] += 1
                wait_until(lambda: stats.dropped_frames + stats.dropped_unexpected >= sum(sent.values()), 20,
                           f"D to take batch {batch}", interval=0.01)
            assert (stats.dropped_frames, stats.dropped_unexpected) == (sent["frames"], sent["unexpected"])
            assert stats.transfers_invalid == 0  # nothing hostile so far touched an expected transfer
            for i, (req, tid) in enumerate(decoys.items()):
                fake_p.send_multipart([hello, *fuzz.invalid_for(req, tid, i)])
            wait_until(lambda: stats.transfers_invalid == len(decoys), 20, "D to refuse every invalid transfer")
            for req, tid in decoys.items():  # duplicates of transfers that are over now
                fake_p.send_multipart([hello, m.encode(fuzz.header(req, tid)), *fuzz.frames([2])])
            wait_until(lambda: stats.dropped_unexpected == sent["unexpected"] + len(decoys), 10, "the duplicates")
            real.join(120)
            assert len(results) == len(prompts)
            for i, (p, r) in enumerate(zip(prompts, results)):
                assert r["error"] is None, r
                references["qwen2"].assert_matches(p, r["tokens"], NEW, f"fuzzed/prompt {i}")
            assert stats.transfers_received == len(prompts)
            flood_prefill(ctx, prefill, rng, fuzz)
            run(wait_blocks_free(client, timeout=10))
            assert all(t.is_alive() for t in engines.threads), "an engine loop ended"
            assert not decode.connector.receiver.pulls and not decode.connector.handoffs
    finally:
        fake_p.close(0)
        ctx.term()


def flood_prefill(ctx: zmq.Context, prefill, rng: random.Random, fuzz: Fuzzer) -> None:
    """10,000 hostile messages at the real prefill's KV port, before and after a valid Hello."""
    sender = prefill.connector.sender
    attacker = ctx.socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(sender.address)
    try:
        before = sender.stats.dropped_frames
        n = [0]
        for batch in range(25):
            if batch == 12:  # from here on as a handshaked peer
                attacker.send(m.encode(m.Hello(sender.compat_hash, sender.description, "attacker")))
                replies = []  # HandshakeRequired answers to the unauthenticated ones, then our HelloAck
                while not any(isinstance(r, m.HelloAck) for r in replies):
                    assert attacker.poll(5000), "no HelloAck from the prefill"
                    replies.append(m.decode(attacker.recv()))
            for _ in range(BATCH):
                attacker.send_multipart(fuzz.malformed() if rng.random() < 0.7 else fuzz.random_header("r", "t"))
                n[0] += 1
            wait_until(lambda: sender.stats.dropped_frames - before >= n[0], 20, f"P to take batch {batch}",
                       interval=0.01)
        assert sender.stats.dropped_frames - before == n[0]
        assert not held(sender) and not pulls(sender)
    finally:
        attacker.close(0)
