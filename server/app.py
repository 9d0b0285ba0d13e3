"""The OpenAI-compatible HTTP front end: `build_app(client, tokenizer, model_name, ...)`.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming as server-sent events or
not), GET /v1/models, GET /health, GET /metrics, POST /tokenize, POST /detokenize.

Order of checks on /v1 generation routes: API key (401) -> capacity (429 + Retry-After) ->
body size (413, before parsing) -> UTF-8 / JSON / schema (400) -> model name (404) -> prompt
and sampling parameters (400). Bad input always ends in a 4xx with an OpenAI error body; a 500
only ever means a bug, and is counted in `app.state.internal_errors`.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.errors import DEFAULT_MAX_BODY_BYTES, APIError, error_response, parse_json, parse_model, read_body
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from server.protocol import EngineClient
from server.serving import MAX_CHOICES, Choice, Serving, check_logprobs_count, sse, usage

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 512


class _ClosingStreamingResponse(StreamingResponse):
    """Runs `on_close` however the response ends (finished, client gone, send failed), even if
    the body iterator never started — the one place that reliably frees a stream's resources."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def build_app(client: EngineClient, tokenizer, model_name: str, api_key: str | None = None,
              max_queue: int = DEFAULT_MAX_QUEUE, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              manage_client: bool = True) -> FastAPI:
    """The FastAPI app serving `client`.

    `tokenizer`: a transformers tokenizer, or None (token-id prompts only). `api_key`: when set,
    /v1/* needs `Authorization: Bearer <key>`. `max_queue`: generation requests in flight beyond
    which new ones get 429. `manage_client`: start the client on startup (always, idempotently
    for LocalEngineClient) and stop it on shutdown (only when True).
    """
    metrics = ServerMetrics(client.instances)
    serving = Serving(client, tokenizer, model_name, metrics, max_queue)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await client.start()
        try:
            yield
        finally:
            if manage_client:
                await client.stop()

    app = FastAPI(title="pdserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.internal_errors = 0

    # -- errors ----------------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(400, f"invalid request: {exc.errors()[:1]}")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        app.state.internal_errors += 1
        logger.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal server error", "server_error")

    # -- helpers ---------------------------------------------------------------------------

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            metrics.http_rejected.labels(status="401").inc()
            raise APIError(401, "invalid or missing API key (send `Authorization: Bearer <key>`)",
                           param=None, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def read(request: Request, model):
        raw = await read_body(request, max_body_bytes)
        return parse_model(model, parse_json(raw))

    # -- generation routes -----------------------------------------------------------------

    async def admit(request: Request, model, handler):
        """Auth, a serving slot, the parsed body, then `handler`: it owns the slot's `release` from
        there (a stream releases it when it ends); anything failing before that releases it here."""
        arrival = time.monotonic()
        check_auth(request)
        release = serving.acquire()
        try:
            req = await read(request, model)
            return await handler(request, req, release, arrival)
        except BaseException:
            release()
            raise

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await admit(request, CompletionRequest, _completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await admit(request, ChatCompletionRequest, _chat)

    async def _completions(request: Request, req: CompletionRequest, release: Callable[[], None], arrival: float):
        stops = serving.check_common(req)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        check_logprobs_count(req.logprobs, "logprobs")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo: echo together with logprobs (prompt logprobs) is not supported", param="echo")
        prompts = _completion_prompts(serving, req)
        if len(prompts) * req.n > MAX_CHOICES:
            raise APIError(400, f"n: prompts x n must be at most {MAX_CHOICES}", param="n")
        request_id = serving.new_request_id("cmpl")
        choices: list[Choice] = []
        for p_idx, ids in enumerate(prompts):
            for j in range(req.n):
                idx = p_idx * req.n + j
                params = serving.sampling_params(req, len(ids), req.max_tokens, req.logprobs, idx)
                c = serving.new_choice(idx, request_id, ids, params, stops, req, arrival)
                if req.echo:
                    c.prompt_text = serving.decode(ids)
                    c.text_offset = len(c.prompt_text)
                choices.append(c)
        streams = serving.submit(choices)
        created = int(time.time())
        base = {"id": request_id, "object": "text_completion", "created": created, "model": model_name}

        def choice_json(c: Choice, text: str, ids: list[int], lps, finish: str | None, first: bool) -> dict:
            d = {"index": c.index, "text": text,
                 "logprobs": serving.completion_logprobs(c, lps) if req.logprobs is not None else None,
                 "finish_reason": finish}
            if finish is not None:
                d["stop_reason"] = c.stop_reason
            if req.return_token_ids:
                d["token_ids"] = ids
                if first:
                    d["prompt_token_ids"] = c.prompt_ids
            return d

        if not req.stream:
            tasks = serving.start(choices, streams, None)
            await serving.wait_all(request, tasks)
            release()
            serving.raise_for_failures(choices)
            return JSONResponse({**base, "choices": [
                choice_json(c, c.prompt_text + c.text, c.token_ids, c.logprobs, c.finish_reason, True) for c in choices
            ], "usage": usage(choices)})

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def preamble() -> list[str]:
            out = []
            for c in choices:
                if req.echo or req.return_token_ids:
                    d = choice_json(c, c.prompt_text, [], [], None, True)
                    if req.logprobs is not None:
                        d["logprobs"] = None
                    out.append(sse({**base, "choices": [d], **({"usage": None} if include_usage else {})}))
            return out

        def on_delta(c: Choice, delta) -> dict | None:
            if not (delta.text or delta.finish_reason or (delta.token_ids and (req.logprobs is not None
                                                                                 or req.return_token_ids))):
                return None
            d = choice_json(c, delta.text, delta.token_ids, delta.logprobs, delta.finish_reason, False)
            return {**base, "choices": [d], **({"usage": None} if include_usage else {})}

        return await _stream(request, serving, choices, streams, preamble, on_delta, base, include_usage, release)

    async def _chat(request: Request, req: ChatCompletionRequest, release: Callable[[], None], arrival: float):
        stops = serving.check_common(req)
        if req.tools:
            raise APIError(400, "tools: tool calling is not supported", param="tools")
        if req.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice: tool calling is not supported", param="tool_choice")
        if req.response_format is not None and req.response_format.type != "text":
            raise APIError(400, "response_format: only {\"type\": \"text\"} is supported", param="response_format")
        check_logprobs_count(req.top_logprobs, "top_logprobs")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        ids = serving.render_chat(req.messages, req.add_generation_prompt, req.continue_final_message)
        request_id = serving.new_request_id("chatcmpl")
        choices = []
        for i in range(req.n):
            params = serving.sampling_params(req, len(ids), max_tokens, logprobs, i)
            choices.append(serving.new_choice(i, request_id, ids, params, stops, req, arrival))
        streams = serving.submit(choices)
        created = int(time.time())
        extra = {"prompt_token_ids": ids} if req.return_token_ids else {}

        if not req.stream:
            tasks = serving.start(choices, streams, None)
            await serving.wait_all(request, tasks)
            release()
            serving.raise_for_failures(choices)
            out = []
            for c in choices:
                d = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                     "logprobs": serving.chat_logprobs(c.logprobs) if req.logprobs else None,
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if req.return_token_ids:
                    d["token_ids"] = c.token_ids
                out.append(d)
            return JSONResponse({"id": request_id, "object": "chat.completion", "created": created,
                                 "model": model_name, "choices": out, "usage": usage(choices), **extra})

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model_name}
        usage_field = {"usage": None} if include_usage else {}

        def preamble() -> list[str]:
            return [sse({**base, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}], **usage_field, **extra})
                    for c in choices]

        def on_delta(c: Choice, delta) -> dict | None:
            if not (delta.text or delta.finish_reason or (delta.token_ids and (req.logprobs or req.return_token_ids))):
                return None
            d = {"index": c.index, "delta": {"content": delta.text} if delta.text else {},
                 "logprobs": serving.chat_logprobs(delta.logprobs) if req.logprobs else None,
                 "finish_reason": delta.finish_reason}
            if delta.finish_reason is not None:
                d["stop_reason"] = c.stop_reason
            if req.return_token_ids:
                d["token_ids"] = delta.token_ids
            return {**base, "choices": [d], **usage_field}

        return await _stream(request, serving, choices, streams, preamble, on_delta, base, include_usage, release)

    # -- other routes ----------------------------------------------------------------------

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [_model_card(model_name, client.max_model_len)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str):
        check_auth(request)
        serving.check_model(model_id)
        return _model_card(model_name, client.max_model_len)

    @app.get("/health")
    async def health():
        if client.is_ready():
            return {"status": "ok"}
        return error_response(503, "the engine is not ready", "server_error", code="not_ready")

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        data = parse_json(await read_body(request, max_body_bytes))
        if "messages" in data:
            chat: TokenizeChatRequest = parse_model(TokenizeChatRequest, data)
            serving.check_model(chat.model)
            ids = serving.render_chat(chat.messages, chat.add_generation_prompt, chat.continue_final_message)
        else:
            plain: TokenizeCompletionRequest = parse_model(TokenizeCompletionRequest, data)
            serving.check_model(plain.model)
            ids = serving.encode(plain.prompt, plain.add_special_tokens)
        return {"count": len(ids), "max_model_len": client.max_model_len, "tokens": ids,
                "token_strs": [serving.token_texts.text(t) for t in ids] if tokenizer is not None else None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req: DetokenizeRequest = parse_model(DetokenizeRequest, parse_json(await read_body(request, max_body_bytes)))
        serving.check_model(req.model)
        serving.check_token_ids(req.tokens, "tokens")
        if tokenizer is None:
            raise APIError(400, "tokens: this model has no tokenizer", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)}

    return app


def _model_card(model_name: str, max_model_len: int) -> dict:
    return {"id": model_name, "object": "model", "created": 0, "owned_by": "pdserve", "root": model_name,
            "max_model_len": max_model_len}


def _completion_prompts(serving: Serving, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        raw: list = [p]
    elif not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    elif isinstance(p[0], int):
        raw = [p]
    else:
        raw = list(p)
    out = []
    for i, item in enumerate(raw):
        param = "prompt" if len(raw) == 1 else f"prompt[{i}]"
        ids = serving.encode(item, req.add_special_tokens, param) if isinstance(item, str) else list(item)
        if not ids:
            raise APIError(400, f"{param} must not be empty", param=param)
        serving.check_token_ids(ids, param)
        out.append(ids)
    return out


async def _stream(request: Request, serving: Serving, choices: list[Choice], streams, preamble: Callable[[], list[str]],
                  on_delta: Callable, base: dict, include_usage: bool, release: Callable[[], None]) -> StreamingResponse:
    """Server-sent events for all choices, interleaved as they come; [DONE] at the end.

    The response starts once every choice has its first event: a request the engine client
    refuses (bad input, no instance available) still gets a real 400/503, not a 200 whose
    stream holds an error. Failures after that arrive as an error event in the stream."""
    events: asyncio.Queue = asyncio.Queue()
    tasks = serving.start(choices, streams, events)
    await serving.wait_started(request, choices, tasks)

    def close() -> None:
        serving.cancel(tasks)  # aborts whatever is still generating (client gone)
        release()

    async def body() -> AsyncIterator[str]:
        try:
            for line in preamble():
                yield line
            remaining = len(choices)
            while remaining:
                choice, delta = await events.get()
                if delta is None:
                    remaining -= 1
                    continue
                if choice.bad_input is not None or (delta.finish_reason == "error"):
                    status = 400 if choice.bad_input is not None else 500
                    message = choice.bad_input or f"generation failed: {choice.error}"
                    yield sse({"error": {"message": message,
                                         "type": "invalid_request_error" if status == 400 else "server_error",
                                         "param": None, "code": status}})
                    continue
                chunk = on_delta(choice, delta)
                if chunk is not None:
                    yield sse(chunk)
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(choices)})
            yield "data: [DONE]\n\n"
        finally:
            close()  # synchronous: this may run inside a cancelled scope

    return _ClosingStreamingResponse(body(), on_close=close, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
