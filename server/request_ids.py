"""`x-request-id` on every response: the client's own, echoed, or a fresh one.

The id is put in the request's ASGI state before any route runs, so a route names its engine
requests and log lines after it (`request_id(request)`), and a client can find its request in the
server's logs and timelines by the id it sent.
"""
from __future__ import annotations

import json
import uuid

from fastapi import Request

HEADER = "x-request-id"
MAX_LEN = 256
_STATE_KEY = "request_id"


def _valid(value: str) -> bool:
    """Printable ASCII without spaces: it is echoed in a header and becomes part of engine request ids."""
    return 0 < len(value) <= MAX_LEN and all("!" <= ch <= "~" for ch in value)


def request_id(request: Request) -> str:
    """This request's id (set by RequestIdMiddleware; a fresh one where the app runs without it)."""
    state = request.scope.setdefault("state", {})
    return state.setdefault(_STATE_KEY, uuid.uuid4().hex)


class RequestIdMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which would get between a stream and its disconnects).

    A client id that is not printable ASCII of at most MAX_LEN characters is refused with a 400
    naming the header: it would otherwise be echoed mangled or land in logs unescaped."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(HEADER.encode())
        value = given.decode("latin-1") if given is not None else uuid.uuid4().hex
        if not _valid(value):
            await _refuse(send, uuid.uuid4().hex)
            return
        scope.setdefault("state", {})[_STATE_KEY] = value
        header = (HEADER.encode(), value.encode())

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


async def _refuse(send, fresh_id: str) -> None:
    body = json.dumps({"error": {"message": f"{HEADER}: must be 1 to {MAX_LEN} printable ASCII characters "
                                            "without spaces", "type": "invalid_request_error", "param": HEADER,
                                 "code": None}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (HEADER.encode(), fresh_id.encode())]})
    await send({"type": "http.response.body", "body": body})
