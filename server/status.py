"""`GET /status`: a live view of the deployment in the browser, and `GET /status.json`, what it polls.

The page (server/static/status.html) is one self-contained file: no build step and nothing from a
CDN, since serving machines often have no internet. It shows each instance (role, health, KV
usage, running/waiting, KV transfer rate), MTP acceptance per draft position, and the recent
requests as a P -> transfer -> D timeline (server/timeline.py).

API key: a browser opening a page cannot send `Authorization: Bearer`, so `/status` also takes
the key as `?key=`; the page then keeps it in sessionStorage, removes it from the address bar, and
sends it as a bearer header on every poll of `/status.json`, which takes the header only (so the
key is not repeated in a URL once a second). Both answer 401 without it.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from importlib.resources import files

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from server.metrics import FRONT_END_COUNTERS
from server.protocol import EngineClient, InstanceInfo
from server.timeline import RequestTrace

RATE_WINDOW_S = 10.0    # transfer rates: the byte counters' growth over (up to) this much time
RECENT_REQUESTS = 30    # timeline rows on the page

_ACCEPTED_PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"
_NUM_DRAFTS = "spec_decode_num_drafts_total"
_ROLE_ORDER = {"prefill": 0, "decode": 1, "colocated": 2}  # rows in the order a request meets them
_BYTES = ("kv_transfer_bytes_sent", "kv_transfer_bytes_received")  # P sends, D receives

# The page is data-free; the policy keeps it to itself (inline script and style, polls only its own
# origin) and `no-referrer` keeps a `?key=` out of any Referer header.
_PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src 'self' data:",
}


class InstanceStatus(msgspec.Struct):
    name: str
    role: str
    ready: bool
    state: str                           # starting | ready | stalled | dead | left
    step_running_s: float                # how long its step in progress has been running
    kv_usage: float                      # 0..1
    kv_blocks_free: int
    kv_blocks_total: int
    num_running: int
    num_waiting: int
    transfer_bytes_total: float          # KV bytes sent (P) or received (D) so far
    transfer_bytes_per_s: float | None   # None until two samples are far enough apart
    transfers: float                     # transfers sent (P) or received (D) so far
    transfer_latency_mean_s: float | None  # D: P's first KV byte sent -> the last one in place, mean so far
    acceptance_per_pos: list[float]      # D with speculation: accepted at position i / verify steps


class Acceptance(msgspec.Struct):
    per_position: list[float]            # all instances together
    num_drafts: float
    mean_acceptance_length: float        # 1 (the bonus token) + accepted drafts per verify step


class StatusSnapshot(msgspec.Struct):
    now: float                           # server wall clock: the page measures ages against it
    mode: str
    ready: bool
    instances: list[InstanceStatus]
    acceptance: Acceptance
    counters: dict[str, float]           # the front end's own (resumes, refused connections, ...)
    requests: list[RequestTrace]         # newest first


class _Rates:
    """Per-second growth of cumulative counters, from samples taken when the page polls."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: dict[str, deque[tuple[float, float]]] = {}

    def update(self, key: str, now: float, value: float) -> float | None:
        samples = self._samples.setdefault(key, deque())
        if samples and value < samples[-1][1]:  # the engine restarted: its counters began again
            samples.clear()
        samples.append((now, value))
        while len(samples) > 2 and now - samples[1][0] >= self.window_s:
            samples.popleft()  # keep one sample at least a window old, so the rate spans the window
        (t0, v0), (t1, v1) = samples[0], samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 - t0 >= 0.5 else None


def _acceptance(num_drafts: float, accepted: list[float]) -> list[float]:
    return [a / num_drafts for a in accepted] if num_drafts else []


class StatusBoard:
    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self._rates = _Rates()

    def snapshot(self) -> StatusSnapshot:
        now = time.time()
        infos = sorted(self.client.instances(), key=lambda i: (_ROLE_ORDER.get(i.role, 3), i.name))
        instances = [self._instance(info, now) for info in infos]
        num_drafts = sum(i.counters.get(_NUM_DRAFTS, 0.0) for i in infos)
        accepted: list[float] = []
        for info in infos:
            for pos, n in enumerate(info.per_position.get(_ACCEPTED_PER_POS, [])):
                accepted += [0.0] * (pos + 1 - len(accepted))
                accepted[pos] += n
        mean_len = 1 + sum(accepted) / num_drafts if num_drafts else 1.0
        counters_of: Callable[[], dict[str, float]] | None = getattr(self.client, "counters", None)
        timeline = getattr(self.client, "timeline", None)  # the in-process client keeps none
        return StatusSnapshot(
            now=now, mode=str(getattr(self.client, "mode", "local")), ready=self.client.is_ready(),
            instances=instances, acceptance=Acceptance(_acceptance(num_drafts, accepted), num_drafts, mean_len),
            counters=dict.fromkeys(FRONT_END_COUNTERS, 0.0) | (counters_of() if counters_of else {}),
            requests=timeline.recent(RECENT_REQUESTS) if timeline is not None else [])

    def _instance(self, info: InstanceInfo, now: float) -> InstanceStatus:
        c = info.counters
        moved = sum(c.get(k, 0.0) for k in _BYTES)
        latency_n = c.get("kv_transfer_latency_seconds_count", 0.0)
        return InstanceStatus(
            name=info.name, role=str(info.role), ready=info.ready, state=info.state,
            step_running_s=info.step_running_s,
            kv_usage=1.0 - info.kv_blocks_free / info.kv_blocks_total if info.kv_blocks_total else 0.0,
            kv_blocks_free=info.kv_blocks_free, kv_blocks_total=info.kv_blocks_total,
            num_running=info.num_running, num_waiting=info.num_waiting,
            transfer_bytes_total=moved, transfer_bytes_per_s=self._rates.update(info.name, now, moved),
            transfers=c.get("kv_transfer_transfers_sent", 0.0) + c.get("kv_transfer_transfers_received", 0.0),
            transfer_latency_mean_s=c.get("kv_transfer_latency_seconds_sum", 0.0) / latency_n if latency_n else None,
            acceptance_per_pos=_acceptance(c.get(_NUM_DRAFTS, 0.0), info.per_position.get(_ACCEPTED_PER_POS, [])))


def add_status_routes(app: FastAPI, client: EngineClient, check_auth: Callable[..., None]) -> None:
    """`check_auth(request, allow_query_key=...)` raises the 401 when an API key is set and not given."""
    board = StatusBoard(client)
    page = (files("server") / "static" / "status.html").read_bytes()

    @app.get("/status")
    async def status_page(request: Request):
        check_auth(request, allow_query_key=True)
        return HTMLResponse(page, headers=_PAGE_HEADERS)

    @app.get("/status.json")
    async def status_json(request: Request):
        check_auth(request)
        return Response(msgspec.json.encode(board.snapshot()), media_type="application/json",
                        headers={"Cache-Control": "no-store"})
