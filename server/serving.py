"""From an OpenAI request to engine requests and back.

A request becomes one `Choice` per (prompt, n) pair, each an engine request with a derived id
(`<request id>-<index>`). Each choice is consumed by its own asyncio task, which turns engine
chunks into text through the incremental detokenizer and the stop-string matcher. A stop-string
match ends the choice and aborts its engine request; so does the consumer going away (client
disconnect, cancel): the tasks are cancelled, which closes the engine streams, which aborts.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field

from fastapi import Request

from engine.grammar import DEFAULT_GRAMMAR_TIMEOUT_S, DEFAULT_MAX_GRAMMAR_BYTES
from engine.types import MAX_LOGPROBS, FinishReason, GrammarSpec, SamplingParams, TokenLogprobs
from engine.validation import InputError, check_prompt, check_token_ids, resolve_max_tokens
from server.chat_template import UnsafeChatInput, render_chat_ids
from server.detokenizer import IncrementalDetokenizer, StopStringMatcher, TokenTexts
from server.errors import APIError, bad_request
from server.grammar_pool import GrammarChecker
from server.metrics import ServerMetrics
from server.openai_schemas import (
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from server.prompt_pool import PromptPool
from server.protocol import EngineClient, EngineUnavailableError, GenerationChunk
from server.request_ids import request_id
from server.response_bodies import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)

logger = logging.getLogger(__name__)

MAX_CHOICES = 256  # prompts x n per HTTP request
_NEG_INF_LOGPROB = -9999.0  # JSON has no -inf


def _finite(x: float) -> float:
    return x if math.isfinite(x) else _NEG_INF_LOGPROB


def sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


# -- one generated sequence -------------------------------------------------------------------

@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: FinishReason | None


@dataclass
class Choice:
    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    prompt_text: str = ""  # echo
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.. (params.prompt_logprobs)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served
    handoff_s: float | None = None  # PD: P's first token -> D's first tokens at the front end
    report_handoff: bool = False  # stream_options.include_pd_handoff
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    bad_input: str | None = None  # a ValueError the engine client raised lazily
    unavailable: str | None = None  # EngineUnavailableError raised lazily
    started: asyncio.Event = field(default_factory=asyncio.Event)  # first event (or failure) is in
    text_offset: int = 0  # completions logprobs: characters before the next token
    # metrics
    arrival: float = 0.0
    last_chunk: float | None = None

    def process(self, chunk: GenerationChunk, metrics: ServerMetrics) -> Delta:
        now = time.monotonic()
        if chunk.queue_time is not None:
            metrics.queue_time.observe(chunk.queue_time)
        if chunk.handoff_s is not None:
            metrics.handoff.observe(chunk.handoff_s)
            self.handoff_s = chunk.handoff_s
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = list(chunk.prompt_logprobs)
        if chunk.num_cached_tokens is not None:
            self.num_cached_tokens = chunk.num_cached_tokens
        ids = list(chunk.token_ids)
        if ids:
            if self.last_chunk is None:
                metrics.ttft.observe(now - self.arrival)
            else:
                metrics.itl.observe(now - self.last_chunk)
            self.last_chunk = now
            metrics.generation_tokens.inc(len(ids))
        # One token at a time, so the result cannot depend on how the engine grouped tokens
        # into chunks (stop strings, min_tokens); tokens after a stop-string match are dropped.
        logprobs = list(chunk.logprobs)
        out, kept = "", 0
        for i, token in enumerate(ids):
            self.token_ids.append(token)
            if i < len(logprobs):
                self.logprobs.append(logprobs[i])
            kept += 1
            out += self.stops.push(self.detok.push([token]), check=len(self.token_ids) >= self.params.min_tokens)
            if self.stops.matched is not None:
                break
        finish = None
        if self.stops.matched is None and chunk.finish_reason is not None:
            out += self.stops.push(self.detok.flush(), check=len(self.token_ids) >= self.params.min_tokens)
        if self.stops.matched is not None:
            finish, self.stop_reason = FinishReason.STOP, self.stops.matched
        elif chunk.finish_reason is not None:
            out += self.stops.flush()
            finish = chunk.finish_reason
            if finish == FinishReason.STOP and self.token_ids and self.token_ids[-1] in self.params.stop_token_ids:
                self.stop_reason = self.token_ids[-1]
            if finish == FinishReason.ERROR:
                self.error = chunk.error or "engine error"
        self.text += out
        if finish is not None:
            self._finish(finish, metrics)
        return Delta(out, ids[:kept], logprobs[:kept], finish)

    def _finish(self, reason: FinishReason, metrics: ServerMetrics) -> None:
        self.finish_reason = reason
        metrics.e2e.observe(time.monotonic() - self.arrival)
        if reason == FinishReason.ERROR:
            metrics.request_errors.inc()
        else:
            metrics.request_success.labels(finished_reason=reason).inc()


# -- the server state shared by the routes -----------------------------------------------------

class Serving:
    def __init__(self, client: EngineClient, tokenizer, model_name: str, metrics: ServerMetrics,
                 max_queue: int, grammar_timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S,
                 max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        # CPU work that must not run on the event loop: compiling grammars, tokenizing prompts.
        self.grammars = GrammarChecker(getattr(tokenizer, "name_or_path", None), client.vocab_size,
                                       client.eos_token_ids, timeout_s=grammar_timeout_s, max_bytes=max_grammar_bytes)
        self.prompts = PromptPool(tokenizer, client.max_model_len)
        self.metrics = metrics
        self.max_queue = max_queue
        self.in_flight = 0
        self.token_texts = TokenTexts(tokenizer)
        self._background: set[asyncio.Task] = set()

    # -- admission -----------------------------------------------------------------------

    def acquire(self) -> Callable[[], None]:
        """Take an in-flight slot or refuse with 429; returns the (idempotent) release."""
        if self.in_flight >= self.max_queue:
            self.metrics.http_rejected.labels(status="429").inc()
            raise APIError(429, f"the server is at capacity ({self.max_queue} requests in flight); retry later",
                           type="server_overloaded", code="server_overloaded", headers={"Retry-After": "1"})
        self.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1
        return release

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    # -- prompts -------------------------------------------------------------------------

    def _need_tokenizer(self, what: str, param: str) -> None:
        if self.tokenizer is None:
            raise APIError(400, f"{param}: this model has no tokenizer, so {what} is not supported; "
                                "send token ids", param=param)

    def close(self) -> None:
        self.grammars.close()
        self.prompts.close()

    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        self._need_tokenizer("text input", param)
        self.prompts.check_length(len(text), param)
        return await self.prompts.run(lambda: list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens)))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def detokenize(self, ids: list[int], param: str) -> str:
        """/detokenize: the ids must be in the vocabulary and the model must have a tokenizer."""
        self.check_token_ids(ids, param)
        if self.tokenizer is None:
            raise APIError(400, f"{param}: this model has no tokenizer", param=param)
        return self.decode(ids)

    def token_strs(self, ids: list[int]) -> list[str] | None:
        return [self.token_texts.text(t) for t in ids] if self.tokenizer is not None else None

    def check_token_ids(self, ids: list[int], param: str) -> None:
        with input_errors():
            check_token_ids(ids, self.client.vocab_size, param)

    def check_prompt(self, ids: list[int], param: str = "prompt") -> None:
        with input_errors():
            check_prompt(ids, self.client.vocab_size, self.client.max_model_len, param)

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          continue_final_message: bool, tools: list[dict] | None = None) -> list[int]:
        self._need_tokenizer("chat", "messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "messages: this model has no chat template; use /v1/completions", param="messages")
        conversation = []
        for i, m in enumerate(messages):
            if m.content is None:
                content = ""
            elif isinstance(m.content, str):
                content = m.content
            else:
                texts = []
                for j, part in enumerate(m.content):
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise APIError(400, f"messages[{i}].content[{j}]: only text content parts are supported",
                                       param=f"messages[{i}].content")
                    texts.append(part["text"])
                content = "\n".join(texts)
            msg = {"role": m.role, "content": content}
            if m.name is not None:
                msg["name"] = m.name
            for key in ("tool_calls", "tool_call_id"):  # tool turns, for templates that render them
                if getattr(m, key) is not None:
                    msg[key] = getattr(m, key)
            conversation.append(msg)
        self.prompts.check_length(sum(len(m["content"]) for m in conversation), "messages")
        try:  # (special-token text in the client's strings stays text: server/chat_template.py)
            return await self.prompts.run(render_chat_ids, self.tokenizer, conversation, tools,
                                          add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message)
        except UnsafeChatInput as exc:
            raise APIError(400, str(exc), param=exc.path) from None
        except Exception as exc:  # template errors (bad roles, flag combinations) are input errors
            raise APIError(400, f"messages: cannot apply the chat template: {exc}", param="messages") from None

    # -- sampling parameters -------------------------------------------------------------

    def sampling_params(self, req: CompletionRequest | ChatCompletionRequest, prompt_len: int,
                        max_tokens: int | None, logprobs: int | None, choice_index: int,
                        prompt_logprobs: int | None = None, grammar: GrammarSpec | None = None) -> SamplingParams:
        with input_errors():
            max_tokens = resolve_max_tokens(prompt_len, max_tokens, self.client.max_model_len)
        seed = None if req.seed is None else req.seed + choice_index
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=self._top_k(req.top_k),
                min_p=0.0 if req.min_p is None else req.min_p,
                seed=seed,
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
                presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
                grammar=grammar,
            )
        except (ValueError, TypeError) as exc:
            raise bad_request(exc) from None

    def _top_k(self, top_k: int | None) -> int:
        """top_k as the engine takes it: as in vLLM, a k that covers the whole vocabulary is no
        top-k at all (0: off), whatever its size; below -1 SamplingParams refuses it."""
        if top_k is None or top_k >= self.client.vocab_size:
            return 0
        return top_k

    def check_common(self, req: CompletionRequest | ChatCompletionRequest) -> list[str]:
        """Checks shared by both endpoints; returns the stop strings."""
        self.check_model(req.model)
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of: only best_of == n is supported", param="best_of")
        stops = req.stop_list()
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop")
        if any(s == "" for s in stops):
            raise APIError(400, "stop: stop strings must not be empty", param="stop")
        if stops:
            self._need_tokenizer("stop strings", "stop")
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        return stops

    # -- running choices -----------------------------------------------------------------

    def new_choice(self, index: int, request_id: str, prompt_ids: list[int], params: SamplingParams,
                   stops: list[str], req, arrival: float) -> Choice:
        options = getattr(req, "stream_options", None)
        return Choice(index=index, request_id=f"{request_id}-{index}", prompt_ids=prompt_ids, params=params,
                      detok=IncrementalDetokenizer(self.tokenizer, req.skip_special_tokens),
                      stops=StopStringMatcher(stops, req.include_stop_str_in_output), arrival=arrival,
                      report_handoff=bool(options and options.include_pd_handoff))

    def submit(self, choices: list[Choice]) -> list[AsyncIterator[GenerationChunk]]:
        """Call `generate` for every choice first, so a ValueError refuses the whole request
        before anything runs (engine streams only start when iterated)."""
        try:
            return [self.client.generate(c.request_id, c.prompt_ids, c.params) for c in choices]
        except ValueError as exc:
            raise bad_request(exc) from None
        except EngineUnavailableError as exc:
            raise unavailable(str(exc)) from None

    def start(self, choices: list[Choice], streams: list[AsyncIterator[GenerationChunk]],
              events: asyncio.Queue | None) -> list[asyncio.Task]:
        prompts = {id(c.prompt_ids): len(c.prompt_ids) for c in choices}
        self.metrics.prompt_tokens.inc(sum(prompts.values()))
        return [asyncio.create_task(self._run_choice(c, s, events)) for c, s in zip(choices, streams)]

    async def _run_choice(self, choice: Choice, stream: AsyncIterator[GenerationChunk],
                          events: asyncio.Queue | None) -> None:
        def emit(delta: Delta | None) -> None:
            if events is not None:
                events.put_nowait((choice, delta))
            choice.started.set()

        try:
            if hasattr(stream, "aclose"):
                async with aclosing(stream):
                    await self._consume(choice, stream, emit)
            else:
                await self._consume(choice, stream, emit)
            if choice.finish_reason is None:
                choice.error = "the engine stream ended without a finish reason"
                choice._finish(FinishReason.ERROR, self.metrics)
                emit(Delta("", [], [], FinishReason.ERROR))
        except ValueError as exc:  # an engine client that validates lazily, on first iteration
            choice.bad_input = str(exc)
            choice.finish_reason = FinishReason.ERROR
            emit(Delta("", [], [], FinishReason.ERROR))
        except EngineUnavailableError as exc:
            choice.unavailable = str(exc) or "no engine instance is available"
            choice.finish_reason = FinishReason.ERROR
            emit(Delta("", [], [], FinishReason.ERROR))
        except asyncio.CancelledError:  # the client went away
            self._abort_later(choice.request_id)
            if choice.finish_reason is None:
                choice._finish(FinishReason.ABORT, self.metrics)
            raise
        except Exception as exc:  # an engine client failure: this choice fails, the server goes on
            logger.exception("request %s failed", choice.request_id)
            choice.error = f"{type(exc).__name__}: {exc}"
            choice._finish(FinishReason.ERROR, self.metrics)
            emit(Delta("", [], [], FinishReason.ERROR))
        finally:
            emit(None)

    async def _consume(self, choice: Choice, stream, emit: Callable[[Delta | None], None]) -> None:
        async for chunk in stream:
            emit(choice.process(chunk, self.metrics))
            if choice.finish_reason is not None:
                if chunk.finish_reason is None:  # ended here by a stop string: free the engine request
                    await self.client.abort(choice.request_id)
                return

    def _abort_later(self, request_id: str) -> None:
        """Abort from a cancelled context (no awaiting there): run it as a task of its own."""
        try:
            task = asyncio.get_running_loop().create_task(self.client.abort(request_id))
        except RuntimeError:
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @staticmethod
    def cancel(tasks: list[asyncio.Task]) -> None:
        for t in tasks:
            if not t.done():
                t.cancel()

    async def run_to_end(self, request: Request, choices: list[Choice], streams: list[AsyncIterator[GenerationChunk]],
                         release: Callable[[], None]) -> None:
        """Non-streaming: run every choice to its end, free the slot, raise the first failure."""
        tasks = self.start(choices, streams, None)
        await self.wait_all(request, tasks)
        release()
        self.raise_for_failures(choices)

    async def wait_all(self, request: Request, tasks: list[asyncio.Task]) -> None:
        """Wait for every choice (non-streaming); abort them all if the client goes away."""
        try:
            await self._wait(request, tasks)
        finally:
            self.cancel(tasks)

    async def wait_started(self, request: Request, choices: list[Choice], tasks: list[asyncio.Task]) -> None:
        """Streaming: wait until every choice has its first event (a token or a failure), so a
        client that validates or dispatches lazily still gets a real HTTP status for errors."""
        try:
            await self._wait(request, [asyncio.ensure_future(c.started.wait()) for c in choices], cleanup=True)
        except BaseException:
            self.cancel(tasks)
            raise
        if any(c.bad_input is not None or c.unavailable is not None for c in choices):
            self.cancel(tasks)
            self.raise_for_failures(choices)

    @staticmethod
    async def _wait(request: Request, awaitables: list[asyncio.Future], cleanup: bool = False) -> None:
        pending = set(awaitables)
        try:
            while pending:
                _, pending = await asyncio.wait(pending, timeout=0.5)
                if pending and await request.is_disconnected():
                    raise APIError(499, "client disconnected")
        finally:
            if cleanup:
                for f in pending:
                    f.cancel()

    @staticmethod
    def raise_for_failures(choices: list[Choice]) -> None:
        for c in choices:
            if c.bad_input is not None:
                raise bad_request(c.bad_input)
        for c in choices:
            if c.unavailable is not None:
                raise unavailable(c.unavailable)
        for c in choices:
            if c.error is not None:
                raise APIError(500, f"generation failed: {c.error}", type="server_error", code="engine_error")

    # -- logprobs formatting -------------------------------------------------------------

    def completion_logprobs(self, choice: Choice, logprobs: list[TokenLogprobs]) -> CompletionLogprobs:
        out, choice.text_offset = self._completion_logprobs(logprobs, choice.text_offset)
        return out

    def echo_logprobs(self, choice: Choice) -> CompletionLogprobs | None:
        """The prompt's part of an `echo` answer's logprobs: its first token has none (null), as in
        OpenAI's completions; offsets count from the start of the prompt."""
        if choice.prompt_logprobs is None:
            return None
        head = self.token_texts.text(choice.prompt_ids[0])
        rest, _ = self._completion_logprobs(choice.prompt_logprobs, len(head))
        return CompletionLogprobs(tokens=[head, *rest.tokens], token_logprobs=[None, *rest.token_logprobs],
                                  top_logprobs=[None, *rest.top_logprobs], text_offset=[0, *rest.text_offset])

    def _completion_logprobs(self, logprobs: list[TokenLogprobs], offset: int) -> tuple[CompletionLogprobs, int]:
        """The logprobs object of these tokens, the first at character `offset`; and the offset after them."""
        tt = self.token_texts
        tokens, token_logprobs, top, offsets = [], [], [], []
        for lp in logprobs:
            text = tt.text(lp.token_id)
            tokens.append(text)
            token_logprobs.append(_finite(lp.logprob))
            entry: dict[str, float] = {}  # token texts can collide ("\ufffd"): keep the best
            for t, v in [(lp.token_id, lp.logprob), *lp.top]:
                entry[tt.text(t)] = max(_finite(v), entry.get(tt.text(t), _NEG_INF_LOGPROB))
            top.append(entry)
            offsets.append(offset)
            offset += len(text)
        out = CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets)
        return out, offset

    def chat_logprobs(self, logprobs: list[TokenLogprobs]) -> ChatLogprobs:
        tt = self.token_texts
        content = []
        for lp in logprobs:
            content.append(TokenLogprob(
                token=tt.text(lp.token_id), logprob=_finite(lp.logprob), bytes=tt.bytes(lp.token_id),
                top_logprobs=[TopLogprob(token=tt.text(t), logprob=_finite(v), bytes=tt.bytes(t)) for t, v in lp.top]))
        return ChatLogprobs(content=content)

    @staticmethod
    def new_request_id(prefix: str, request: Request) -> str:
        """The engine request id: the route's prefix and the HTTP request's x-request-id (so logs,
        timelines and the client's header name the same request)."""
        return f"{prefix}-{request_id(request)}"


@contextmanager
def input_errors() -> Iterator[None]:
    """engine.validation's InputError as a 400 naming its field (and code, e.g. context_length_exceeded)."""
    try:
        yield
    except InputError as exc:
        raise APIError(400, str(exc), param=exc.param, code=exc.code) from None


def unavailable(message: str) -> APIError:
    return APIError(503, message or "no engine instance is available", type="server_error",
                    code="engine_unavailable", headers={"Retry-After": "1"})


def usage(choices: list[Choice]) -> Usage:
    """A request's total usage. A prompt shared by n choices counts once, and so do its cached tokens:
    the most any of its choices had served by the prefix cache."""
    prompts = {id(c.prompt_ids): len(c.prompt_ids) for c in choices}
    cached: dict[int, int] = {}
    for c in choices:
        cached[id(c.prompt_ids)] = max(cached.get(id(c.prompt_ids), 0), c.num_cached_tokens)
    prompt_tokens = sum(prompts.values())
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())))


def choice_usage(choice: Choice, num_completion_tokens: int) -> Usage:
    """One choice's usage so far, for stream_options.continuous_usage_stats (as vLLM sends it)."""
    prompt_tokens = len(choice.prompt_ids)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=num_completion_tokens,
                 total_tokens=prompt_tokens + num_completion_tokens)


def check_logprobs_count(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{param} must be an integer in [0, {MAX_LOGPROBS}], got {value}", param=param)
