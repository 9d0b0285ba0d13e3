"""The one seam between an engine and KV transfer (DESIGN.md §5), shaped after vLLM's KV
connector: the engine process builds one connector for its role, and from there on the process
loop, the engine core and the scheduler call the same methods whatever the role.

    colocated  KVConnector        does nothing: the KV never leaves the process
    prefill    PrefillConnector   marks requests to stop after t0; keeps their blocks after they
                                  finish, sends them to the decode instance that pulls them, and
                                  frees them on its ack, its release or when the lease runs out
    decode     DecodeConnector    marks requests whose KV comes from a prefill instance; once the
                                  scheduler has reserved their blocks, pulls the KV into them and
                                  reports each transfer done or failed

Calls, by who makes them:
    process    on_new_request(request, prefill_endpoint), abort(req_id), sockets(), counters(), close()
    core       poll() -> (loaded, failed): transfers finished since the last call
    scheduler  start_load(request): blocks reserved, fetch the KV (status WAITING_FOR_KV)
               request_finished(request) -> True when the connector now owns the request's blocks
"""
from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import torch
import zmq

from engine.config import KVTransferConfig
from engine.request import Request
from engine.types import EngineRole, FinishReason
from kv_transfer.handshake import compat_hash
from kv_transfer.receiver import Completed, Failed, KVReceiver
from kv_transfer.sender import KVSender

logger = logging.getLogger(__name__)

KVEvents = tuple[list[Completed], list[Failed]]


class KVConnector:
    """The colocated (no-op) connector; the base of the other two."""

    role: EngineRole = EngineRole.COLOCATED
    kv_endpoint: str = ""  # where decode instances dial this engine's KV port (prefill only)

    def on_new_request(self, request: Request, prefill_endpoint: str) -> None:
        """Mark what the request needs from KV transfer, before the scheduler sees it."""

    def start_load(self, request: Request) -> None:
        """Decode: the scheduler reserved `request.block_ids`; pull the prompt's KV into them."""

    def request_finished(self, request: Request) -> bool:
        """True when the connector keeps the finished request's blocks (it frees them itself)."""
        return False

    def abort(self, req_id: str) -> None:
        """The front end aborted the request: drop any transfer of it, and tell the peer."""

    def poll(self) -> KVEvents:
        """Serve the KV port(s); the transfers that landed and those that failed since the last poll."""
        return [], []

    def sockets(self) -> list[zmq.Socket]:
        """Sockets the process loop should wake up for."""
        return []

    def counters(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class PrefillConnector(KVConnector):
    role = EngineRole.PREFILL

    def __init__(self, sender: KVSender, kv_endpoint: str) -> None:
        self.sender = sender
        self.kv_endpoint = kv_endpoint

    def on_new_request(self, request: Request, prefill_endpoint: str) -> None:
        request.remote_decode = True  # stop after t0: the decode instance generates the rest

    def request_finished(self, request: Request) -> bool:
        if request.finish_reason != FinishReason.HANDED_OFF:
            return False  # finished here (t0 was a stop, an abort, an error): nothing to send
        # The sender's lease is the one record of these blocks from now on (freed on ack/expiry).
        self.sender.hold(request.req_id, list(request.block_ids), request.prompt_len, request.output_token_ids[0])
        return True

    def abort(self, req_id: str) -> None:
        self.sender.drop(req_id, "aborted")

    def poll(self) -> KVEvents:
        self.sender.poll()
        return [], []

    def sockets(self) -> list[zmq.Socket]:
        return [self.sender.socket]

    def counters(self) -> dict[str, float]:
        return self.sender.stats.as_counters()

    def close(self) -> None:
        self.sender.close()


class DecodeConnector(KVConnector):
    role = EngineRole.DECODE

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver

    def on_new_request(self, request: Request, prefill_endpoint: str) -> None:
        request.kv_source = prefill_endpoint  # the scheduler reserves blocks, then start_load pulls

    def start_load(self, request: Request) -> None:
        self.receiver.start(request.req_id, request.kv_source, request.block_ids)

    def abort(self, req_id: str) -> None:
        self.receiver.cancel(req_id, "aborted")

    def poll(self) -> KVEvents:
        return self.receiver.poll()

    def sockets(self) -> list[zmq.Socket]:
        return self.receiver.sockets()

    def counters(self) -> dict[str, float]:
        return self.receiver.stats.as_counters()

    def close(self) -> None:
        self.receiver.close()


def get_kv_connector(role: EngineRole, ctx: zmq.Context, kv_cache: torch.Tensor, compat: dict, name: str,
                     free_blocks: Callable[[list[int]], None], kv: KVTransferConfig) -> KVConnector:
    """The connector for `role`. `compat` describes the KV layout (handshake.compat_description);
    `free_blocks` gives blocks back to the engine's block manager (prefill: after the transfer)."""
    chash, desc_text = compat_hash(compat), str(compat)
    if role == EngineRole.PREFILL:
        sender = KVSender(ctx, kv.addr or "tcp://127.0.0.1:0", kv_cache, chash, desc_text, name,
                          lambda _req_id, blocks: free_blocks(blocks), kv.lease_s, kv.key)
        return PrefillConnector(sender, kv.advertise or advertised(sender.address))
    if role == EngineRole.DECODE:
        return DecodeConnector(KVReceiver(ctx, kv_cache, chash, desc_text, name, kv.deadline_s, kv.key))
    return KVConnector()


def advertised(bound: str) -> str:
    """The address peers should dial for a socket bound on all interfaces (tcp://0.0.0.0:P)."""
    if bound.startswith("tcp://0.0.0.0:"):
        return f"tcp://{socket.gethostbyname(socket.gethostname())}:{bound.rsplit(':', 1)[1]}"
    return bound
