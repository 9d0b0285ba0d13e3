"""OpenAI-shaped errors and careful request-body parsing.

Every error body is `{"error": {"message", "type", "param", "code"}}`. Body parsing never lets
bad input escape as anything but an `APIError`: size is checked before parsing (413), then
strict UTF-8, then JSON, then the pydantic model (400 for each).
"""
from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# An oversized body is read and thrown away up to this many bytes, so the client still gets
# the 413 instead of a reset connection; beyond it the connection is simply not read further.
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024


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


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, or 413 when it is over `limit` bytes (by Content-Length or as it arrives)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise APIError(400, "invalid Content-Length header") from None
        if size > limit:
            await _drain(request)
            raise _too_large(limit)
    parts: list[bytes] = []
    received = 0
    async for part in request.stream():
        received += len(part)
        if received > limit:
            await _drain(request, received)
            raise _too_large(limit)
        parts.append(part)
    return b"".join(parts)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than the limit of {limit} bytes", code="request_too_large")


async def _drain(request: Request, already: int = 0) -> None:
    received = already
    try:
        async for part in request.stream():
            received += len(part)
            if received > DRAIN_LIMIT_BYTES:
                break
    except Exception:  # the client went away or the stream was consumed: nothing left to drain
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
