"""A prefill instance restarted at the same KV address (a container restart, the fault drill's
`kill -9` + restart) must serve decode instances that handshaked with its predecessor, at once —
not after their reservation deadline. Found by benchmarks/fault_drill.py: the new process dropped
the old connection's pulls as unauthenticated, and the requests hung for the full 60 s."""
from __future__ import annotations

import time
from pathlib import Path

import torch
import zmq
from kv_harness import FakeClock, held, kv_shape, pump

from kv_transfer import messages as m
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender

SHAPE = kv_shape()


def transfer(sender: KVSender, receiver: KVReceiver, req_id: str, blocks: list[int]) -> tuple[list, list]:
    """Hold on P, pull on D, pump both until D has it or gave up; returns (done, failed)."""
    sender.hold(req_id, blocks, len(blocks) * SHAPE[3], t0=7)
    receiver.start(req_id, sender.address, blocks)
    return pump(sender, receiver)


def test_decode_re_handshakes_with_a_prefill_restarted_at_the_same_address(tmp_path: Path):
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/p-kv"
    src, dst = torch.randn(SHAPE), torch.zeros(SHAPE)
    released: list[str] = []

    def release(req_id: str, _blocks: list[int]) -> None:
        released.append(req_id)

    # D's clock stands still: whatever D does, no timer of its own (deadline, resume, re-Hello)
    # can be what gets the second transfer through; only the messages can.
    clock = FakeClock()
    receiver = KVReceiver(ctx, dst, "h", "d", "decode-0", deadline_s=60.0, clock=clock)
    first = KVSender(ctx, addr, src, "h", "d", "prefill-0", release)
    try:
        done, failed = transfer(first, receiver, "r1", [0, 1])
        assert [d.req_id for d in done] == ["r1"] and not failed
        deadline = time.monotonic() + 5
        while not released and time.monotonic() < deadline:  # D's ack frees r1's blocks on P
            first.poll()
            time.sleep(0.005)
        first.close()  # the process dies; a new one binds the same address with a fresh cache
        src2 = torch.randn(SHAPE)
        second = KVSender(ctx, addr, src2, "h", "d", "prefill-0", release)
        try:
            done, failed = transfer(second, receiver, "r2", [2, 3])
            assert [d.req_id for d in done] == ["r2"] and not failed, (done, failed)
            # At once: D's clock never moved, so no deadline or timer of D's got it through (a pull
            # resumed on the reconnect is message-driven), and nothing was given up on the way.
            assert clock.now == 1000.0 and receiver.stats.transfers_stalled == 0
            assert torch.equal(dst[:, :, 2:4], src2[:, :, 2:4])
            # Either D saw the reconnect and said Hello before pulling, or its stale pull was refused
            # and retried after Hello: which comes first is a race between D's monitor and its pull.
            assert receiver.stats.reconnects >= 1 or second.stats.dropped_frames >= 1
            deadline = time.monotonic() + 5
            while len(released) < 2 and time.monotonic() < deadline:
                second.poll()
                time.sleep(0.005)
            assert released == ["r1", "r2"] and not held(second)  # D acked: P freed its blocks
        finally:
            second.close()
    finally:
        receiver.close()
        ctx.term()


def test_unknown_connection_is_told_to_handshake(tmp_path: Path):
    """Any well-formed message from a connection P never handshaked with gets HandshakeRequired."""
    ctx = zmq.Context()
    sender = KVSender(ctx, f"ipc://{tmp_path}/p-kv", torch.zeros(SHAPE), "h", "d", "prefill-0", lambda *_: None)
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(sender.address)
    try:
        stranger.send(m.encode(m.KeepAlive(["x"])))
        deadline = time.monotonic() + 5
        reply = None
        while reply is None and time.monotonic() < deadline:
            sender.poll()
            if stranger.poll(10):
                reply = m.decode(stranger.recv())
        assert isinstance(reply, m.HandshakeRequired)
        assert sender.stats.dropped_frames == 1
    finally:
        stranger.close(0)
        sender.close()
        ctx.term()
