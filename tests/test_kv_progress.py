"""Deadlines that follow progress, leases renewed while D pulls, transfers resumed with what
already landed, and byte counters that agree (issue 44). Clocks are fake: the deadlines under
test run on `clock=`, messages still travel over real ipc:// sockets, and every wait is bounded."""
from __future__ import annotations

import time

import pytest
import torch
import zmq
from kv_harness import FakeClock, FakePrefill, held, kv_shape, layer_message, pulls, pump, settle
from tcp_relay import TcpRelay

from kv_transfer import messages as m
from kv_transfer import sender as sender_module
from kv_transfer.connector import advertised
from kv_transfer.receiver import RESUME_AFTER_S, KVReceiver
from kv_transfer.sender import KVSender, missing

SHAPE = kv_shape(3)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.term()


def test_a_long_prefill_queue_is_progress_and_the_lease_follows_the_pull(ctx, tmp_path):
    """P takes far longer than D's no-progress bound to compute the KV, answering D's KeepAlives
    with KVPending: D does not give up, and P's pending pull is renewed past its own lease."""
    clock = FakeClock()
    src = torch.randn(SHAPE)
    sender = KVSender(ctx, f"ipc://{tmp_path}/p", src, "h", "{}", "prefill-0", lambda *_: None, lease_s=3.0,
                      clock=clock)
    receiver = KVReceiver(ctx, torch.zeros(SHAPE), "h", "{}", "decode-0", deadline_s=2.0, clock=clock)
    try:
        receiver.start("r", sender.address, [0, 1], "t", 8)
        pump(sender, receiver, until=lambda d, f: ("r", "t") in pulls(sender))
        for _ in range(12):  # 18 s of fake time: 9 no-progress bounds, 6 leases
            clock.advance(1.5)
            _, failed = settle(receiver, sender, receiver)
            assert not failed and "r" in receiver.pulls and ("r", "t") in pulls(sender)
        sender.hold("r", [0, 1], 8, 5, "t")
        done, _ = pump(sender, receiver, until=lambda d, f: d)
        assert done[0].req_id == "r" and receiver.stats.transfers_stalled == 0
    finally:
        sender.close()
        receiver.close()


def test_a_silent_transfer_is_given_up_after_the_no_progress_bound(ctx, tmp_path):
    clock = FakeClock()
    fake = FakePrefill(ctx, f"ipc://{tmp_path}/p")  # handshakes, then never says another word
    receiver = KVReceiver(ctx, torch.zeros(SHAPE), "h", "{}", "decode-0", deadline_s=2.0, clock=clock)
    try:
        receiver.start("r", f"ipc://{tmp_path}/p", [0, 1], "t", 8)
        fake.expect(m.PullKV, receiver)
        clock.advance(1.9)
        assert not settle(receiver)[1]
        clock.advance(0.2)
        _, failed = pump(receiver, until=lambda d, f: f)
        assert "no progress for 2 s" in failed[0].reason and failed[0].retryable
        assert receiver.stats.transfers_stalled == 1 and not receiver.pulls
        assert fake.expect(m.Release, receiver).req_id == "r"
    finally:
        receiver.close()
        fake.sock.close(0)


def test_a_transfer_still_receiving_is_never_abandoned(ctx, tmp_path):
    """Pieces arrive 1.5 s apart against a 2 s bound: 9 s of transfer in all, and it lands."""
    clock = FakeClock()
    fake = FakePrefill(ctx, f"ipc://{tmp_path}/p")
    src = torch.randn(SHAPE)
    dst = torch.zeros(SHAPE)
    receiver = KVReceiver(ctx, dst, "h", "{}", "decode-0", deadline_s=2.0, clock=clock)
    n = 12
    try:
        receiver.start("r", f"ipc://{tmp_path}/p", [0, 1, 2], "t", n)
        fake.expect(m.PullKV, receiver)
        for layer in range(3):
            for a, b in ((0, 6), (6, n)):
                clock.advance(1.5)
                fake.send(*layer_message(src, "r", layer, a, b, n))
                _, failed = settle(receiver)
                assert not failed
        fake.send(m.encode(m.KVLayersDone("r", "t", "prefill-0", n, 3, 7)))
        done, _ = pump(receiver, until=lambda d, f: d)
        assert done[0].req_id == "r" and torch.equal(dst[:, :, :3], src[:, :, :3])
    finally:
        receiver.close()
        fake.sock.close(0)


def test_a_quiet_pull_is_resumed_naming_what_landed(ctx, tmp_path):
    """Layer 0 arrives, then nothing: D asks again with PullKV(resume, have={0: all}); the rest
    completes it and layer 0 is not needed again."""
    clock = FakeClock()
    fake = FakePrefill(ctx, f"ipc://{tmp_path}/p")
    src = torch.randn(SHAPE)
    dst = torch.zeros(SHAPE)
    receiver = KVReceiver(ctx, dst, "h", "{}", "decode-0", deadline_s=30.0, clock=clock)
    n = 10
    try:
        receiver.start("r", f"ipc://{tmp_path}/p", [0, 1, 2], "t", n)
        first = fake.expect(m.PullKV, receiver)
        assert not first.resume and not first.have
        fake.send(*layer_message(src, "r", 0, 0, n, n))
        settle(receiver)
        clock.advance(RESUME_AFTER_S + 0.5)
        again = fake.expect(m.PullKV, receiver)
        assert again.resume and again.have == {0: [[0, n]]}
        for layer in (1, 2):
            fake.send(*layer_message(src, "r", layer, 0, n, n))
        fake.send(m.encode(m.KVLayersDone("r", "t", "prefill-0", n, 3, 7)))
        done, _ = pump(receiver, until=lambda d, f: d)
        assert done[0].req_id == "r" and torch.equal(dst[:, :, :2], src[:, :, :2])
        assert receiver.stats.transfers_resumed == 1
    finally:
        receiver.close()
        fake.sock.close(0)


class FakeDecode:
    """A DEALER speaking D's side by hand: what P sends is collected, nothing is acked."""

    def __init__(self, ctx: zmq.Context, sender: KVSender) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(sender.address)
        self.sender = sender
        self.send(m.Hello("h", "{}", "fake-decode"))
        assert isinstance(self.next(), m.HelloAck)

    def send(self, msg: m.Message) -> None:
        self.sock.send(m.encode(msg))

    def next(self, timeout: float = 5.0) -> m.Message:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sender.poll()
            if self.sock.poll(10):
                return m.decode(self.sock.recv_multipart()[0])
        raise TimeoutError("nothing from the sender")

    def until_done(self) -> list[m.KVLayer]:
        layers = []
        while not isinstance(msg := self.next(), m.KVLayersDone):
            assert isinstance(msg, m.KVLayer), msg
            layers.append(msg)
        return layers


@pytest.mark.parametrize("layerwise", [False, True])
def test_prefill_resends_only_what_decode_lacks(ctx, tmp_path, monkeypatch, layerwise):
    """A resumed pull names layers 0 and 1 (and half of 2) as landed: P sends only the rest, in
    frames no larger than MAX_FRAME_BYTES, and counts a resume rather than another transfer."""
    monkeypatch.setattr(sender_module, "MAX_FRAME_BYTES", 4 * 2 * 2 * 8 * 4)  # 4 positions a frame
    src = torch.randn(SHAPE)
    sender = KVSender(ctx, f"ipc://{tmp_path}/p", src, "h", "{}", "prefill-0", lambda *_: None,
                      layerwise=layerwise)
    d = FakeDecode(ctx, sender)
    n = 10
    try:
        d.send(m.PullKV("r", "t"))
        d.sender.poll()
        sender.hold("r", [0, 1, 2], n, 5, "t")
        # After the prefill (nothing was streamed), and larger than a frame: pieces, not one KVHeader.
        assert {(p.layer, p.start, p.end) for p in d.until_done()} == {
            (layer, a, min(a + 4, n)) for layer in range(3) for a in (0, 4, 8)}
        d.send(m.PullKV("r", "t", {0: [[0, n]], 1: [[0, n]], 2: [[0, 5]]}, resume=True))
        pieces = d.until_done()
        assert [(p.layer, p.start, p.end) for p in pieces] == [(2, 5, 9), (2, 9, 10)]
        assert sender.stats.transfers_resumed == 1 and sender.stats.transfers_sent == 1
        assert missing([[0, 3], [5, 7]], 9) == [(3, 5), (7, 9)]
    finally:
        d.sock.close(0)
        sender.close()


def test_layerwise_lease_is_renewed_while_decode_waits_then_the_rest_is_resumed(ctx, tmp_path):
    """Only layer 0 is streamed before the prefill ends: D keeps pulling (its KeepAlives renew P's
    lease well past it), goes quiet, resumes naming layer 0, and P sends layers 1 and 2 only."""
    clock = FakeClock()
    src = torch.randn(SHAPE)
    dst = torch.zeros(SHAPE)
    sender = KVSender(ctx, f"ipc://{tmp_path}/p", src, "h", "{}", "prefill-0", lambda *_: None, lease_s=2.0,
                      layerwise=True, clock=clock)
    receiver = KVReceiver(ctx, dst, "h", "{}", "decode-0", deadline_s=30.0, clock=clock)
    n, blocks = 8, [0, 1]
    try:
        receiver.start("r", sender.address, blocks, "t", n)
        pump(sender, receiver, until=lambda d, f: ("r", "t") in pulls(sender))
        sender.publish_layer("r", "t", 0, 0, n, n, src[0].reshape(2, -1, *SHAPE[4:])[:, :n].clone())
        sender.hold("r", blocks, n, 4, "t")
        pump(sender, receiver, until=lambda d, f: receiver.pulls["r"].layers_done is not None)
        start = clock.now
        for _ in range(4):  # 4 s of fake time against a 2 s lease, less than RESUME_AFTER_S
            clock.advance(1.1)
            settle(receiver, sender, receiver)
            assert ("r", "t") in held(sender) and sender.stats.leases_expired == 0
        done: list = []
        while not done and clock.now < start + 3 * RESUME_AFTER_S:  # KeepAlives go on renewing the lease
            clock.advance(1.1)
            done = settle(receiver, sender, receiver)[0]
        assert sender.stats.leases_expired == 0
        assert done[0].req_id == "r" and torch.equal(dst[:, :, :2], src[:, :, :2])
        assert receiver.stats.layers_received == 3 and sender.stats.transfers_resumed == 1
        pump(sender, until=lambda d, f: not held(sender))  # D's ack frees P's blocks
        counters = sender.counters()
        assert counters["kv_transfer_bytes_sent"] == receiver.stats.bytes_received
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("mode", ["whole", "pieces", "layerwise"])
def test_bytes_sent_equal_bytes_received_hidden_states_included(ctx, tmp_path, monkeypatch, mode):
    """P hands D the MTP layer's place as hidden states: both sides count those bytes too."""
    if mode == "pieces":
        monkeypatch.setattr(sender_module, "MAX_FRAME_BYTES", 512)
    src = torch.randn(SHAPE)
    hidden = torch.randn(3, 16)
    sender = KVSender(ctx, f"ipc://{tmp_path}/p", src, "h", "{}", "prefill-0", lambda *_: None,
                      layerwise=mode == "layerwise", draft_layers=1)
    receiver = KVReceiver(ctx, torch.zeros(SHAPE), "h", "{}", "decode-0", draft_layers=1, hidden_size=16)
    n, blocks = 10, [0, 1, 2]
    try:
        receiver.start("r", sender.address, blocks, "t", n)
        pump(sender, receiver, until=lambda d, f: ("r", "t") in pulls(sender))
        if mode == "layerwise":
            for layer in range(2):
                sender.publish_layer("r", "t", layer, 0, n, n, src[layer].reshape(2, -1, *SHAPE[4:])[:, :n].clone())
        sender.hold("r", blocks, n, 4, "t", hidden)
        done, _ = pump(sender, receiver, until=lambda d, f: d)
        assert torch.equal(done[0].hidden, hidden)
        pump(sender, until=lambda d, f: not held(sender))
        assert sender.counters()["kv_transfer_bytes_sent"] == receiver.stats.bytes_received > hidden.nbytes
        assert receiver.stats.latency_seconds_count == 1
    finally:
        sender.close()
        receiver.close()


def test_a_wildcard_bind_is_never_advertised_as_loopback(monkeypatch):
    from kv_transfer import connector

    assert advertised("tcp://127.0.0.1:5700") == "tcp://127.0.0.1:5700"  # one host: loopback is right
    assert advertised("tcp://0.0.0.0:5700", "tcp://p0:5700") == "tcp://p0:5700"
    monkeypatch.setattr(connector, "routable_ip", lambda: "10.213.0.7")
    assert advertised("tcp://0.0.0.0:5700") == "tcp://10.213.0.7:5700"
    assert advertised("tcp://0.0.0.0:5700", "tcp://{ip}:5701") == "tcp://10.213.0.7:5701"
    monkeypatch.setattr(connector, "routable_ip", lambda: None)
    with pytest.raises(ValueError, match="--kv-advertise"):
        advertised("tcp://0.0.0.0:5700")
    monkeypatch.undo()
    monkeypatch.setattr(connector.socket, "gethostbyname", lambda _name: "127.0.1.1")
    ip = connector.routable_ip()
    assert ip is None or not ip.startswith("127.")


def test_a_transfer_broken_by_a_reconnect_resumes_from_what_landed(ctx, monkeypatch):
    """The connection breaks after part of the KV crossed (P's ROUTER drops the rest it had
    queued): D sees the reconnect, says Hello again and asks for the rest, which is all P sends."""
    monkeypatch.setattr(sender_module, "MAX_FRAME_BYTES", 1024)  # 8 positions a frame
    src = torch.randn(SHAPE)
    dst = torch.zeros(SHAPE)
    sender = KVSender(ctx, "tcp://127.0.0.1:0", src, "h", "{}", "prefill-0", lambda *_: None)
    relay = TcpRelay(int(sender.address.rsplit(":", 1)[1]), budget=6000)
    receiver = KVReceiver(ctx, dst, "h", "{}", "decode-0")
    n, blocks = 32, list(range(8))
    whole = 3 * n * 2 * 2 * 8 * 4  # layers x positions x K/V x heads x dim x 4 bytes
    try:
        receiver.start("r", f"tcp://127.0.0.1:{relay.port}", blocks, "t", n)
        pump(sender, receiver, until=lambda d, f: ("r", "t") in pulls(sender))
        sender.hold("r", blocks, n, 5, "t")
        pump(sender, receiver, until=lambda d, f: relay.budget <= 0)
        settle(sender, receiver)
        landed = sum(b - a for spans in receiver.pulls["r"].covered.values() for a, b in spans)
        assert 0 < landed < 3 * n  # part of it
        relay.sever()
        done, _ = pump(sender, receiver, until=lambda d, f: d, timeout=10)
        assert done[0].req_id == "r" and torch.equal(dst, src)
        assert receiver.stats.reconnects == 1 and receiver.stats.transfers_resumed == 1
        assert sender.stats.transfers_resumed == 1
        # The resend carried only what had not landed: less than the whole transfer a second time.
        assert sender.stats.bytes_sent <= whole + (3 * n - landed) * 128
        assert receiver.stats.bytes_received < 2 * whole
    finally:
        relay.close()
        sender.close()
        receiver.close()


def test_the_stream_splits_a_layer_larger_than_a_frame(ctx, tmp_path, monkeypatch):
    """No frame exceeds MAX_FRAME_BYTES in layer-wise mode either: a big chunk of a layer goes as
    several KVLayer messages, and D puts them together."""
    monkeypatch.setattr(sender_module, "MAX_FRAME_BYTES", 512)  # 4 positions a frame
    src = torch.randn(SHAPE)
    dst = torch.zeros(SHAPE)
    sender = KVSender(ctx, f"ipc://{tmp_path}/p", src, "h", "{}", "prefill-0", lambda *_: None, layerwise=True)
    receiver = KVReceiver(ctx, dst, "h", "{}", "decode-0")
    n, blocks = 10, [0, 1, 2]
    try:
        receiver.start("r", sender.address, blocks, "t", n)
        pump(sender, receiver, until=lambda d, f: ("r", "t") in pulls(sender))
        for layer in range(3):
            sender.publish_layer("r", "t", layer, 0, n, n, src[layer].reshape(2, -1, *SHAPE[4:])[:, :n].clone())
        sender.hold("r", blocks, n, 4, "t")
        done, _ = pump(sender, receiver, until=lambda d, f: d)
        assert done[0].req_id == "r" and torch.equal(dst[:, :, :2], src[:, :, :2])
        assert torch.equal(dst[:, :, 2, :2], src[:, :, 2, :2])
        assert receiver.stats.layers_received == sender.counters()["kv_transfer_layers_sent"] == 3 * 3
    finally:
        sender.close()
        receiver.close()
