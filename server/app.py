"""The OpenAI-compatible HTTP front end: `build_app(client, tokenizer, model_name, ...)`.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (streaming as
server-sent events or not), GET /v1/models, GET /health, GET /metrics, POST /tokenize, POST /detokenize, and the live
status page GET /status with its GET /status.json (server/status.py). Each route
is a few lines over the serving layer (server/serving.py, completions.py, chat.py).

Order of checks on /v1 generation routes, /tokenize and /detokenize: API key (401) -> capacity
(429 + Retry-After) -> body size (413, before parsing) -> UTF-8 / JSON / schema (400) -> model
name (404) -> prompt and sampling parameters (400). Bad input always ends in a 4xx with an OpenAI error body; a 500
only ever means a bug, and is counted in `app.state.internal_errors`. Every response carries an
`x-request-id` header (server/request_ids.py).
"""
from __future__ import annotations

import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.grammar import DEFAULT_GRAMMAR_TIMEOUT_S, DEFAULT_MAX_GRAMMAR_BYTES
from server.chat import create_chat_completion
from server.completions import create_completion
from server.errors import DEFAULT_MAX_BODY_BYTES, APIError, error_response, parse_json, parse_model, read_body
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from server.protocol import EngineClient
from server.request_ids import HEADER, RequestIdMiddleware, request_id
from server.response_bodies import DetokenizeResponse, HealthResponse, ModelCard, ModelList, TokenizeResponse
from server.responses_api import create_response
from server.serving import Serving
from server.status import add_status_routes

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 512


def build_app(client: EngineClient, tokenizer, model_name: str, api_key: str | None = None,
              max_queue: int = DEFAULT_MAX_QUEUE, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              manage_client: bool = True, grammar_timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S,
              max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES) -> FastAPI:
    """The FastAPI app serving `client`.

    `tokenizer`: a transformers tokenizer, or None (token-id prompts only). `api_key`: when set,
    /v1/* needs `Authorization: Bearer <key>`. `max_queue`: generation requests in flight beyond
    which new ones get 429. `manage_client`: start the client on startup (always, idempotently
    for the tests' in-process client) and stop it on shutdown (only when True). `grammar_timeout_s`,
    `max_grammar_bytes`: the budget of one structured-output grammar (server/grammar_pool.py).
    """
    metrics = ServerMetrics(client.instances, getattr(client, "counters", None))
    serving = Serving(client, tokenizer, model_name, metrics, max_queue, grammar_timeout_s, max_grammar_bytes)
    loaded_at = int(time.time())  # the tokenizer and engine client are in hand: /v1/models' `created`

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await client.start()
        try:
            yield
        finally:
            serving.close()
            if manage_client:
                await client.stop()

    app = FastAPI(title="pdserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.internal_errors = 0
    app.add_middleware(RequestIdMiddleware)
    _add_error_handlers(app)
    gate = _Gate(serving, api_key, max_body_bytes)
    _add_generation_routes(app, gate)
    _add_other_routes(app, gate, serving, client, loaded_at)
    add_status_routes(app, client, gate.check_auth)
    return app


class _Gate:
    """What stands before a route: the API key, a serving slot, the body."""

    def __init__(self, serving: Serving, api_key: str | None, max_body_bytes: int) -> None:
        self.serving, self.api_key, self.max_body_bytes = serving, api_key, max_body_bytes

    def check_auth(self, request: Request, allow_query_key: bool = False) -> None:
        """`allow_query_key`: `?key=` may stand for the header (a page a browser opens: /status)."""
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if allow_query_key and not scheme:
            scheme, token = "bearer", request.query_params.get("key", "")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            self.serving.metrics.http_rejected.labels(status="401").inc()
            raise APIError(401, "invalid or missing API key (send `Authorization: Bearer <key>`)",
                           param=None, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def json(self, request: Request):
        return parse_json(await read_body(request, self.max_body_bytes))

    @asynccontextmanager
    async def slot(self, request: Request) -> AsyncIterator[dict]:
        """Auth and a serving slot (429 at capacity), held while the body is parsed and answered:
        /tokenize and /detokenize are work the front end does, and count as requests in flight."""
        self.check_auth(request)
        release = self.serving.acquire()
        try:
            yield await self.json(request)
        finally:
            release()

    async def admit(self, request: Request, model, handler) -> Response:
        """Auth, a serving slot, the parsed body, then `handler`: it owns the slot's `release` from
        there (a stream releases it when it ends); anything failing before that releases it here."""
        arrival = time.monotonic()
        self.check_auth(request)
        release = self.serving.acquire()
        try:
            req = parse_model(model, await self.json(request))
            return await handler(self.serving, request, req, release, arrival)
        except BaseException:
            release()
            raise


def _add_error_handlers(app: FastAPI) -> None:
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
        # Answered outside the middleware stack, so the x-request-id header is set here.
        app.state.internal_errors += 1
        rid = request_id(request)
        logger.error("internal error on %s %s (request %s)", request.method, request.url.path, rid, exc_info=exc)
        return error_response(500, "internal server error", "server_error", headers={HEADER: rid})


def _add_generation_routes(app: FastAPI, gate: _Gate) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await gate.admit(request, CompletionRequest, create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await gate.admit(request, ChatCompletionRequest, create_chat_completion)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await gate.admit(request, ResponsesRequest, create_response)


def _add_other_routes(app: FastAPI, gate: _Gate, serving: Serving, client: EngineClient, loaded_at: int) -> None:
    def model_card() -> ModelCard:
        return ModelCard(id=serving.model_name, created=loaded_at, root=serving.model_name,
                         max_model_len=client.max_model_len)

    @app.get("/v1/models")
    async def list_models(request: Request):
        gate.check_auth(request)
        return ModelList(data=[model_card()]).body()

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str):
        gate.check_auth(request)
        serving.check_model(model_id)
        return model_card().body()

    @app.get("/health")
    async def health():
        if client.is_ready():
            return HealthResponse().body()
        return error_response(503, "the engine is not ready", "server_error", code="not_ready")

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        async with gate.slot(request) as data:
            if "messages" in data:
                chat: TokenizeChatRequest = parse_model(TokenizeChatRequest, data)
                serving.check_model(chat.model)
                ids = await serving.render_chat(chat.messages, chat.add_generation_prompt, chat.continue_final_message)
            else:
                plain: TokenizeCompletionRequest = parse_model(TokenizeCompletionRequest, data)
                serving.check_model(plain.model)
                ids = await serving.encode(plain.prompt, plain.add_special_tokens)
            return TokenizeResponse(count=len(ids), max_model_len=client.max_model_len, tokens=ids,
                                    token_strs=serving.token_strs(ids)).body()

    @app.post("/detokenize")
    async def detokenize(request: Request):
        async with gate.slot(request) as data:
            req: DetokenizeRequest = parse_model(DetokenizeRequest, data)
            serving.check_model(req.model)
            return DetokenizeResponse(prompt=serving.detokenize(req.tokens, "tokens")).body()
