"""What the KV-transfer tests (tests/test_kv_*.py) share: the cache shape and sampling they use,
clocks a test moves by hand, a pump for a sender/receiver pair driven from the test's thread, a
prefill port spoken by hand, and one prefill + one decode engine (threads) behind a running
RemoteEngineClient. Engine-level helpers in general live in tests/pd_harness.py."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq
from pd_harness import ThreadedEngines, client_for, running_client, wait_ready

from engine.config import EngineConfig, KVTransferConfig
from engine.process import EngineProcess
from engine.types import SamplingParams
from kv_transfer import messages as m
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender, frames_checksum
from server.pd_client import RemoteEngineClient

VOCAB = 384  # the random checkpoints' vocabulary (conftest.make_checkpoint)


def kv_shape(layers: int = 2) -> tuple[int, ...]:
    """A small KV cache: [layers, K/V, blocks, block_size, kv_heads, head_dim]."""
    return (layers, 2, 8, 4, 2, 8)


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy, EOS ignored: every request makes exactly `max_tokens` tokens, comparable to the reference."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# -- clocks ----------------------------------------------------------------------------------


class FakeClock:
    """A monotonic clock that stands still until the test advances it: deadlines under test fire
    exactly when the test says, however slow the machine."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class JumpClock:
    """The real monotonic clock plus the jumps the test made: for engines running in threads,
    whose other timers must keep running while one deadline is moved by hand."""

    def __init__(self) -> None:
        self.skew = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.skew

    def advance(self, seconds: float) -> None:
        self.skew += seconds


# -- a sender and a receiver driven from the test's thread ---------------------------------------


def held(sender: KVSender) -> dict:
    """The transfers P holds finished KV of, by key."""
    return {k: t.held for k, t in sender.transfers.items() if t.held is not None}


def pulls(sender: KVSender) -> dict:
    """D's pulls that wait on P for the prefill to finish, by key."""
    return {k: t.pull for k, t in sender.transfers.items() if t.pull is not None}


def streaming(sender: KVSender) -> set:
    """The transfers with layers published to P's stream."""
    return {k for k, t in sender.transfers.items() if t.on_stream}


def pump(*parties, until: Callable[[list, list], object] = lambda done, failed: done or failed,
         timeout: float = 5.0) -> tuple[list, list]:
    """Poll every sender and receiver until `until(done, failed)` holds over what the receivers
    reported (default: anything); raises TimeoutError after `timeout` real seconds."""
    done, failed = [], []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for party in parties:
            if isinstance(party, KVReceiver):
                d, f = party.poll()
                done += d
                failed += f
            else:
                party.poll()
        if until(done, failed):
            return done, failed
        time.sleep(0.005)
    raise TimeoutError("the transfer did not get there")


def settle(*parties, seconds: float = 0.1) -> tuple[list, list]:
    """Let in-flight messages arrive and be handled (real time)."""
    deadline = time.monotonic() + seconds
    return pump(*parties, until=lambda d, f: time.monotonic() > deadline, timeout=seconds + 5)


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


def layer_message(src: torch.Tensor, req: str, layer: int, start: int, end: int, n: int,
                  checksum: bool = True) -> list[bytes]:
    """The frames of one KVLayer message carrying positions [start, end) of `layer` of `src`
    (the prompt's blocks are 0, 1, 2, ... in order)."""
    block_size = src.shape[3]
    blocks = torch.arange(src.shape[2])
    pos = torch.arange(start, end)
    slots = blocks[pos // block_size] * block_size + pos % block_size
    kv = src[layer].reshape(2, -1, *src.shape[4:]).index_select(1, slots).contiguous()
    frame = kv.numpy().tobytes()
    header = m.KVLayer(req, "t", "prefill-0", layer, start, end, n, "float32",
                       frames_checksum([frame]) if checksum else None)
    return [m.encode(header), frame]


# -- one prefill and one decode engine behind a client -------------------------------------------


@dataclass
class PDPair:
    prefill: EngineProcess
    decode: EngineProcess
    client: RemoteEngineClient
    run: Callable  # run(coro, timeout=...) on the client's event loop (pd_harness.running_client)
    engines: ThreadedEngines


@contextmanager
def pd_pair(tmp_path: Path, model: str, max_model_len: int, *, prefill: dict | None = None,
            decode: dict | None = None, prefill_kv: KVTransferConfig | None = None,
            decode_kv: KVTransferConfig | None = None,
            before_start: Callable[[EngineProcess, EngineProcess], None] | None = None,
            **client_kwargs) -> Iterator[PDPair]:
    """prefill-0 and decode-0 as threads of this process, registered with a running client.
    `prefill`/`decode`: EngineConfig fields beyond the common ones; `prefill_kv`/`decode_kv`: the
    engines' KV settings; `before_start(prefill, decode)`
    patches the engines before their loops start; `client_kwargs` go to the RemoteEngineClient.
    The engines stop when the block ends."""
    engines = ThreadedEngines(tmp_path)
    common = dict(model=model, max_model_len=max_model_len, num_threads=1)
    p = engines.add("prefill", "prefill-0", EngineConfig(**{**common, **(prefill or {})}), prefill_kv)
    d = engines.add("decode", "decode-0", EngineConfig(**{**common, **(decode or {})}), decode_kv)
    if before_start is not None:
        before_start(p, d)
    engines.start()
    client = client_for(engines.server_addr, model, "pd", max_model_len, **client_kwargs)
    try:
        with running_client(client) as run:
            run(wait_ready(client))
            yield PDPair(p, d, client, run, engines)
    finally:
        engines.stop()
