"""The one seam between an engine and KV transfer (docs/architecture.md, KV transfer), shaped after vLLM's KV
connector: the engine process builds one connector for its role, and from there on the process
loop, the engine core and the scheduler call the same methods whatever the role.

    colocated  KVConnector        does nothing: the KV never leaves the process
    prefill    PrefillConnector   marks requests to stop after t0; keeps their blocks after they
                                  finish, sends them to the decode instance that pulls them (in
                                  layer-wise mode: each layer as the forward writes it, through
                                  the runner's KV tap), and frees them on its ack, its release or
                                  when the lease runs out
    decode     DecodeConnector    marks requests whose KV comes from a prefill instance; once the
                                  scheduler has reserved their blocks, pulls the KV into them and
                                  reports each transfer done or failed

Calls, by who makes them:
    process    on_new_request(request, kv_endpoint), abort(req_id, transfer_id), sockets(), counters(),
               close()
    core       poll() -> (loaded, failed): transfers finished since the last call
               on_scheduled(req_ids): requests entering a slot this step (D: the hand-off is over)
    runner     (through the KV tap, prefill only) tap_target(req_id), on_layer(...): a layer's KV
               of a prompt's positions is written; on_hidden(...): the target's hidden states of
               a prompt's last positions, which go to D in place of the MTP layers' KV
    scheduler  start_load(request): blocks reserved, fetch the KV (status WAITING_FOR_KV)
               request_finished(request) -> True when the connector now owns the request's blocks

A transfer is named by (request id, `request.transfer_id`, P instance): the front end picks a
new transfer id for every attempt, so a retry never takes an older attempt's KV.

The per-transfer state of each side is one object (engine/request.py): a `PrefillHandoff` or a
`DecodeHandoff`, which the connector keeps by request id (`handoffs`) and the request points at
(`request.handoff`). What P keeps after the prompt is done -- the lease on its blocks, the layer
stream -- is the sender's (kv_transfer/sender.py); what D keeps while it pulls, the receiver's.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import socket
import struct
import time
from collections.abc import Callable

import torch
import zmq

from engine.cluster_key import ClusterKey
from engine.config import KVTransferConfig
from engine.request import DecodeHandoff, PrefillHandoff, Request
from engine.types import EngineRole, FinishReason, KVTransferMode
from kv_transfer.handshake import compat_hash, describe_difference
from kv_transfer.receiver import Completed, Failed, KVReceiver
from kv_transfer.sender import KVSender

logger = logging.getLogger(__name__)

KVEvents = tuple[list[Completed], list[Failed]]


class KVConnector:
    """The colocated (no-op) connector; the base of the other two."""

    role: EngineRole = EngineRole.COLOCATED
    kv_endpoint: str = ""  # P's KV address: where decode instances dial this engine's KV port (prefill only)
    taps_layers = False    # the runner reports each layer's KV writes (tap_target, on_layer)

    def step_seconds(self, tokens: int) -> float | None:
        """What the engine predicts a step of `tokens` tokens costs (EngineCore points this at its
        scheduler's StepCost.predict); None: unknown."""
        return None

    def on_new_request(self, request: Request, kv_endpoint: str) -> None:
        """Mark what the request needs from KV transfer, before the scheduler sees it (`kv_endpoint`:
        decode role, the KV address of the prefill instance the prompt's KV comes from; "": none)."""

    def start_load(self, request: Request) -> None:
        """Decode: the scheduler reserved `request.block_ids`; pull the prompt's KV into them."""

    def request_finished(self, request: Request) -> bool:
        """True when the connector keeps the finished request's blocks (it frees them itself)."""
        return False

    def abort(self, req_id: str, transfer_id: str | None = None) -> None:
        """The front end aborted the request (that attempt only, when `transfer_id` is given):
        drop any transfer of it, and tell the peer."""

    def poll(self) -> KVEvents:
        """Serve the KV port(s); the transfers that landed and those that failed since the last poll."""
        return [], []

    def on_scheduled(self, req_ids: list[str]) -> None:
        """These requests enter a slot in the step about to run."""

    def tap_target(self, req_id: str) -> int | None:
        """The prompt length whose KV the runner should report for `req_id`, None: not this one."""
        return None

    def snapshots(self, req_id: str) -> bool:
        """Whether the runner hands `on_layer` a host copy of each layer's KV of `req_id` (layer-wise push)."""
        return False

    def on_layer(self, req_id: str, layer: int, start: int, end: int, kv: torch.Tensor,
                 ready: torch.cuda.Event | None) -> None:
        """KV `layer` of positions [start, end) of `req_id`'s prompt is written (`kv`: its host copy)."""

    def on_layers_done(self, req_id: str) -> None:
        """The forward of the last KV layer over `req_id`'s last prompt chunk is over."""

    def on_hidden(self, req_id: str, start: int, hidden: torch.Tensor) -> None:
        """The target's hidden states of `req_id`'s prompt positions [start, start + len(hidden)):
        handed to D with the KV, for its MTP drafter (chunks come in order)."""

    def sockets(self) -> list[zmq.Socket]:
        """Sockets the process loop should wake up for."""
        return []

    def counters(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


# A prefill step predicted at least this long streams its prompts' layers whatever their length:
# the next step, which a whole transfer waits out, costs more than the layer snapshots would.
LAYERWISE_MIN_STEP_S = 0.25


class PrefillConnector(KVConnector):
    """Taps layers in both modes: the end of the last KV layer's forward over a prompt is what the
    hand-off latency (D's kv_transfer_handoff_seconds) is measured from."""

    role = EngineRole.PREFILL
    taps_layers = True

    def __init__(self, sender: KVSender, kv_endpoint: str, layerwise_min_tokens: int | None = None) -> None:
        """`layerwise_min_tokens`: stream the layers of prompts at least this long (None: never)."""
        self.sender = sender
        self.kv_endpoint = kv_endpoint
        self.layerwise_min_tokens = layerwise_min_tokens
        self.handoffs: dict[str, PrefillHandoff] = {}  # until the request finishes here

    def on_new_request(self, request: Request, kv_endpoint: str) -> None:
        # The hand-off makes the request stop after t0: the decode instance generates the rest.
        request.handoff = self.handoffs[request.req_id] = PrefillHandoff(request)
        self.sender.supersede(request.req_id, request.transfer_id)  # a retry here: the old attempt is over

    def tap_target(self, req_id: str) -> int | None:
        handoff = self.handoffs.get(req_id)
        return handoff.request.num_handoff_tokens if handoff is not None else None

    def snapshots(self, req_id: str) -> bool:
        """Whether this request's KV goes out layer by layer (else whole, once its prefill is over):
        prompts of at least layerwise_min_tokens, and any prompt whose step this engine predicts
        to be long. Sent whole, a prompt's KV leaves when the engine thread next handles D's pull,
        after the step that follows its prefill: on a model whose steps take seconds that wait is
        the hand-off, while the snapshots cost the step a fixed amount per layer."""
        handoff = self.handoffs.get(req_id)
        if handoff is None or self.layerwise_min_tokens is None:
            return False
        n = handoff.request.num_handoff_tokens
        if n >= self.layerwise_min_tokens:
            return True
        predicted = self.step_seconds(n)
        return predicted is not None and predicted >= LAYERWISE_MIN_STEP_S

    def on_layer(self, req_id: str, layer: int, start: int, end: int, kv: torch.Tensor,
                 ready: torch.cuda.Event | None) -> None:
        request = self.handoffs[req_id].request
        self.sender.publish_layer(req_id, request.transfer_id, layer, start, end, request.num_handoff_tokens, kv,
                                  ready)

    def on_layers_done(self, req_id: str) -> None:
        self.handoffs[req_id].prefill_done_time = time.time()  # what the hand-off latency is measured from

    def on_hidden(self, req_id: str, start: int, hidden: torch.Tensor) -> None:
        self.handoffs[req_id].add_hidden(start, hidden.to("cpu", copy=True))  # (a slice of the step's hidden states)

    def request_finished(self, request: Request) -> bool:
        handoff = request.handoff
        if handoff is not None and self.handoffs.get(request.req_id) is handoff:
            del self.handoffs[request.req_id]
        if request.finish_reason != FinishReason.HANDED_OFF or not isinstance(handoff, PrefillHandoff):
            self.sender.end_stream(request.req_id, request.transfer_id)
            return False  # finished here (t0 was a stop, an abort, an error): nothing to send
        # The sender's lease is the one record of these blocks from now on (freed on ack/expiry).
        # The KV of num_handoff_tokens positions and the token after them: t0, or for a resumed
        # request the last token the client was streamed.
        n, pieces = request.num_handoff_tokens, handoff.hidden
        hidden = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)) if pieces else None
        self.sender.hold(request.req_id, list(request.block_ids), n, request.all_token_ids[n], request.transfer_id,
                         hidden, handoff.prefill_done_time)
        return True

    def abort(self, req_id: str, transfer_id: str | None = None) -> None:
        handoff = self.handoffs.get(req_id)
        if handoff is not None and transfer_id in (None, handoff.request.transfer_id):
            del self.handoffs[req_id]  # also when the scheduler refused it (it never finishes then)
            self.sender.end_stream(req_id, handoff.request.transfer_id)
        self.sender.drop(req_id, "aborted", transfer_id)

    def poll(self) -> KVEvents:
        self.sender.poll()
        return [], []

    def sockets(self) -> list[zmq.Socket]:
        return [self.sender.socket]

    def counters(self) -> dict[str, float]:
        return self.sender.counters()

    def close(self) -> None:
        self.sender.close()


class DecodeConnector(KVConnector):
    """Also keeps the reservation deadline: a request whose blocks the scheduler could not reserve
    within `reserve_deadline_s` (memory taken by running requests) fails with a retryable error
    instead of waiting behind them for ever, and its P is told to release its KV."""

    role = EngineRole.DECODE

    def __init__(self, receiver: KVReceiver, reserve_deadline_s: float = 20.0) -> None:
        self.receiver = receiver
        self.reserve_deadline_s = reserve_deadline_s
        self.handoffs: dict[str, DecodeHandoff] = {}  # until the request enters a slot (or ends)

    def on_new_request(self, request: Request, kv_endpoint: str) -> None:
        if kv_endpoint:  # the scheduler reserves blocks, then start_load pulls
            deadline = self.receiver.clock() + self.reserve_deadline_s
            request.handoff = self.handoffs[request.req_id] = DecodeHandoff(request, kv_endpoint, deadline)

    def start_load(self, request: Request) -> None:
        handoff = request.handoff
        assert isinstance(handoff, DecodeHandoff), "the scheduler reserves blocks only for a request awaiting KV"
        handoff.reserve_by = None
        self.receiver.start(request.req_id, handoff.kv_endpoint, request.block_ids, request.transfer_id,
                            request.num_handoff_tokens)

    def request_finished(self, request: Request) -> bool:
        handoff = self.handoffs.get(request.req_id)
        if handoff is not None and handoff.request is request:  # ended before it entered a slot
            del self.handoffs[request.req_id]
        return False

    def abort(self, req_id: str, transfer_id: str | None = None) -> None:
        handoff = self.handoffs.get(req_id)
        if handoff is not None and transfer_id in (None, handoff.request.transfer_id):
            del self.handoffs[req_id]
        self.receiver.cancel(req_id, "aborted", transfer_id)

    def on_scheduled(self, req_ids: list[str]) -> None:
        """The hand-off is over: the request runs here from now on."""
        stats = self.receiver.stats
        for req_id in req_ids:
            handoff = self.handoffs.pop(req_id, None)
            if handoff is None:
                continue
            handoff.request.handoff = None  # once: after a preemption the prompt is computed here, without P's hidden
            if handoff.prefill_done_time:  # wall clock on both sides: meaningful on one host (or NTP-close hosts)
                stats.handoff_seconds_sum += max(0.0, time.time() - handoff.prefill_done_time)
                stats.handoff_seconds_count += 1

    def poll(self) -> KVEvents:
        done, failed = self.receiver.poll()
        for item in done:
            if (handoff := self.handoffs.get(item.req_id)) is not None:
                handoff.prefill_done_time = item.prefill_done_time
        now = self.receiver.clock()  # the receiver's clock: one clock for every decode-side deadline
        for req_id, handoff in list(self.handoffs.items()):
            if handoff.reserve_by is not None and handoff.reserve_by < now:
                del self.handoffs[req_id]
                request = handoff.request
                reason = (f"decode {self.receiver.name} had no KV memory for the prompt's "
                          f"{request.prompt_len} tokens within {self.reserve_deadline_s:g} s")
                self.receiver.release(req_id, handoff.kv_endpoint, request.transfer_id, reason)
                self.receiver.stats.reservations_expired += 1
                failed.append(Failed(req_id, reason))
        return done, failed

    def sockets(self) -> list[zmq.Socket]:
        return self.receiver.sockets()

    def counters(self) -> dict[str, float]:
        return self.receiver.stats.as_counters()

    def close(self) -> None:
        self.receiver.close()


def get_kv_connector(role: EngineRole, ctx: zmq.Context, kv_cache: torch.Tensor, compat: dict, name: str,
                     free_blocks: Callable[[list[int]], None], kv: KVTransferConfig,
                     cluster_key: ClusterKey | None = None) -> KVConnector:
    """The connector for `role`. `compat` describes the KV layout (handshake.compat_description);
    `free_blocks` gives blocks back to the engine's block manager (prefill: after the transfer);
    `cluster_key` makes the KV sockets CURVE-only."""
    chash, desc_text = compat_hash(compat), json.dumps(compat, sort_keys=True)
    model = compat.get("config") or {}
    draft_layers = kv_cache.shape[0] - (model.get("num_hidden_layers") or kv_cache.shape[0])  # the MTP layers'
    hidden_size = model.get("hidden_size") or 0
    if role == EngineRole.PREFILL:
        sender = KVSender(ctx, kv.addr or "tcp://127.0.0.1:0", kv_cache, chash, desc_text, name,
                          lambda _req_id, blocks: free_blocks(blocks), kv.lease_s, kv.key, kv.checksum,
                          lambda theirs: describe_difference(compat, theirs), cluster_key,
                          layerwise=kv.mode == KVTransferMode.LAYERWISE, draft_layers=draft_layers)
        return PrefillConnector(sender, advertised(sender.address, kv.advertise),
                                kv.layerwise_min_tokens if kv.mode == KVTransferMode.LAYERWISE else None)
    if role == EngineRole.DECODE:
        receiver = KVReceiver(ctx, kv_cache, chash, desc_text, name, kv.deadline_s, kv.key, model.get("vocab_size"),
                              cluster_key=cluster_key, draft_layers=draft_layers, hidden_size=hidden_size)
        return DecodeConnector(receiver, kv.reserve_deadline_s)
    return KVConnector()


WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]")
LOCAL_IP = "{ip}"  # in --kv-advertise: this host's routable address (routable_ip)


def advertised(bound: str, advertise: str = "") -> str:
    """The KV address decode instances dial: `advertise` (with LOCAL_IP filled in) where given,
    else `bound`, except that a wildcard bind (tcp://0.0.0.0:P) is no address anyone can dial: it
    becomes this host's routable address, never loopback (peers on other hosts would dial
    themselves). Raises ValueError, saying what to set, where no such address is found."""
    if advertise:
        return advertise.replace(LOCAL_IP, _local_ip(advertise)) if LOCAL_IP in advertise else advertise
    host, _, port = bound.removeprefix("tcp://").rpartition(":")
    if not bound.startswith("tcp://") or host not in WILDCARD_HOSTS:
        return bound
    address = f"tcp://{_local_ip(bound)}:{port}"
    logger.warning("KV port bound to %s without --kv-advertise: decode instances are told to dial %s (this "
                   "host's routable address); set --kv-advertise where another address reaches it", bound, address)
    return address


def _local_ip(what: str) -> str:
    ip = routable_ip()
    if ip is None:
        raise ValueError(f"KV port {what}: found no non-loopback address of this host to advertise to decode "
                         "instances on other hosts; set --kv-advertise tcp://HOST:PORT")
    return ip


def routable_ip() -> str | None:
    """This host's IPv4 address as other hosts see it: the hostname's, unless that is loopback (as
    /etc/hosts often makes it), else the source address of the route to the outside, else the
    first address of an interface that is up and not loopback; None when there is none."""
    try:
        ip = socket.gethostbyname(socket.gethostname())
        if not ipaddress.ip_address(ip).is_loopback:
            return ip
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # a documentation address: a UDP connect sends nothing
            ip = probe.getsockname()[0]
            if not ipaddress.ip_address(ip).is_loopback:
                return ip
    except OSError:  # no default route
        pass
    return _interface_ip()


def _interface_ip() -> str | None:
    """The first IPv4 address of a non-loopback interface (Linux; None elsewhere or where none has one)."""
    try:
        import fcntl
        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:  # no IPv4 address on it
                continue
            ip = socket.inet_ntoa(packed[20:24])
            if not ipaddress.ip_address(ip).is_loopback:
                return ip
    return None
