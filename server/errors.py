"""OpenAI-shaped errors and careful request-body parsing.

Every error body is `{"error": {"message", "type", "param", "code"}}`. Body parsing never lets
bad input escape as anything but an `APIError`: size is checked before parsing (413), then
strict UTF-8, then JSON, then the pydantic model (400 for each).
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# An oversized body is read and thrown away up to this many bytes, so the client still gets
# the 413 instead of a reset connection; beyond it the connection is simply not read further.
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024
CLOSE = {"Connection": "close"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


_PARAM_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*)(?::| must| is)")


def bad_request(exc_or_message: Exception | str, param: str | None = None) -> APIError:
    """A 400 from a ValueError (whose message names the field first, by project convention)."""
    message = str(exc_or_message)
    if param is None:
        m = _PARAM_RE.match(message)
        param = m.group(1) if m else None
    return APIError(400, message, param=param)


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The raw body, or 413 when it is over `limit` bytes (by Content-Length or as it arrives), or
    408 when it has not all arrived within `timeout_s`. A refusal before the whole body was read
    closes the connection (`Connection: close`): what the client still sends is never read."""
    declared = request.headers.get("content-length")
    if declared is not None and "transfer-encoding" in request.headers:
        # Two framings at once is how requests are smuggled past a proxy that reads the other one.
        raise APIError(400, "Content-Length and Transfer-Encoding must not be sent together", headers=CLOSE)
    deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise APIError(400, "invalid Content-Length header", headers=CLOSE) from None
        if size > limit:
            if size <= DRAIN_LIMIT_BYTES:  # a client that sends it all reads the 413 after it
                await _drain(request, deadline)
            raise _too_large(limit)
    try:
        async with asyncio.timeout_at(deadline):
            body = await _receive(request, limit)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout",
                       headers=CLOSE) from None
    except ClientDisconnect:  # nobody is left to answer; 499 as nginx logs it
        raise APIError(499, "client disconnected before sending the whole body") from None
    if body is None:
        await _drain(request, deadline, limit)
        raise _too_large(limit)
    return body


async def _receive(request: Request, limit: int) -> bytes | None:
    """The body, or None as soon as it is over `limit` bytes."""
    parts: list[bytes] = []
    received = 0
    async for part in request.stream():
        received += len(part)
        if received > limit:
            return None
        parts.append(part)
    return b"".join(parts)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than the limit of {limit} bytes", code="request_too_large",
                    headers=CLOSE)


async def _drain(request: Request, deadline: float | None, already: int = 0) -> None:
    """Read and drop the rest of the body, up to DRAIN_LIMIT_BYTES and until `deadline`."""
    received = already
    try:
        async with asyncio.timeout_at(deadline):
            while received <= DRAIN_LIMIT_BYTES:  # raw messages: works however much was read before
                message = await request.receive()
                received += len(message.get("body", b""))
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break
    except Exception:  # timed out or the client went away: stop draining
        pass


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}"[:500]) from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    _check_strings(data)
    return data


def _check_strings(root: Any) -> None:
    """Refuse lone UTF-16 surrogates (legal as JSON escapes, not as text): they can be neither
    tokenized nor encoded back to UTF-8. Iterative, so deep nesting cannot overflow the stack."""
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, f"{path or 'body'}: string contains an unpaired surrogate escape",
                               param=path or None) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, path))
                stack.append((v, f"{path}.{k}" if path else str(k)))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))


def parse_model(model: type[BaseModel], data: dict[str, Any]) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in err.get("loc", ()))
        raise APIError(400, f"{loc or 'body'}: {err.get('msg', 'invalid value')}", param=loc or None) from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None
