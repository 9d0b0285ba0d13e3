"""`LocalEngineClient`: the EngineClient protocol served by an in-process `EngineCore`.

The core runs in one background thread whose loop reads top to bottom: take commands (add,
abort, stop) from a thread-safe inbox -> step while there is work, else block on the inbox ->
hand each step's updates to the asyncio loops that asked for them (one
`call_soon_threadsafe` per loop per step) -> publish a stats snapshot. Only that thread
touches the core after construction; the event loop side only validates (read-only config),
enqueues commands and reads the snapshot.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.grammar_prep import GrammarPrep
from engine.request import RequestStatus
from engine.types import EngineRole, FinishReason, SamplingParams
from server.protocol import GenerationChunk, InstanceInfo

logger = logging.getLogger(__name__)

INSTANCE_NAME = "colocated-0"


@dataclass
class _Sink:
    """Where one request's chunks go: an asyncio queue owned by `loop`."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    submit_time: float
    scheduled: bool = False
    queue_time: float | None = None  # measured, not yet delivered


def _merge(a: GenerationChunk, b: GenerationChunk) -> GenerationChunk:
    """Coalesce two queued chunks of one request (a slow consumer gets fewer, larger chunks)."""
    return GenerationChunk(a.token_ids + b.token_ids, a.logprobs + b.logprobs, b.finish_reason, b.error,
                           a.queue_time if a.queue_time is not None else b.queue_time,
                           a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
                           a.num_cached_tokens if a.num_cached_tokens is not None else b.num_cached_tokens)


def _deliver(items: list[tuple[asyncio.Queue, GenerationChunk]]) -> None:
    for q, chunk in items:
        q.put_nowait(chunk)


# How often an idle engine thread looks for grammars that finished compiling (an engine process
# polls its sockets as often: engine/process.py IDLE_POLL_MS).
GRAMMAR_POLL_S = 0.02


class LocalEngineClient:
    """Runs an `EngineCore` in a background thread of this process (the colocated baseline)."""

    def __init__(self, config: EngineConfig | None = None, *, core: EngineCore | None = None) -> None:
        self.core = core if core is not None else EngineCore(config or EngineConfig())
        self.max_model_len: int = int(self.core.config.max_model_len)
        self.vocab_size: int = int(self.core.model_config.vocab_size)
        self.eos_token_ids: list[int] = list(self.core.model_config.eos_token_ids)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._dead: str | None = None  # why the engine loop died, if it did
        self._lock = threading.Lock()
        self._active: set[str] = set()  # request ids with a live stream (caller side)
        self._sinks: dict[str, _Sink] = {}  # engine-thread side
        self._grammars = GrammarPrep(self.core.compile_grammar)  # compiled before admission, off the loop
        self._snapshot = self._make_snapshot()

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread (idempotent)."""
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
            self._thread.start()

    async def stop(self) -> None:
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._inbox.put(("stop",))
        await asyncio.to_thread(thread.join, 30)

    def is_ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    def instances(self) -> list[InstanceInfo]:
        return [self._snapshot]

    # -- requests ------------------------------------------------------------------------

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        """Validate now (ValueError is raised here, in the caller), submit on first iteration."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        self.core.validate_prompt(prompt_token_ids, params)
        with self._lock:
            if request_id in self._active:
                raise ValueError(f"request_id {request_id!r} is already in use")
        return self._stream(request_id, list(prompt_token_ids), params)

    async def _stream(self, request_id: str, prompt: list[int],
                      params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        if not self.is_ready():
            yield GenerationChunk([], finish_reason=FinishReason.ERROR, error=self._dead or "engine is not running")
            return
        with self._lock:
            if request_id in self._active:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._active.add(request_id)
        q: asyncio.Queue = asyncio.Queue()
        finished = False
        try:
            self._inbox.put(("add", request_id, prompt, params, _Sink(asyncio.get_running_loop(), q, time.monotonic())))
            while not finished:
                chunk = await q.get()
                while chunk.finish_reason is None and not q.empty():
                    chunk = _merge(chunk, q.get_nowait())
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            if not finished:  # the consumer stopped early (disconnect, cancel, stop string)
                self._inbox.put(("abort", request_id, False))
            with self._lock:
                self._active.discard(request_id)

    async def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, True))

    # -- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if not self._handle_commands(block=not self.core.has_unfinished()):
                    break
                for ready in self._grammars.ready():
                    self._admit(*ready.item, ready.grammar, ready.error)
                if self.core.has_unfinished():
                    step_start = time.monotonic()
                    updates = self.core.step()
                    self._dispatch(updates, step_start)
                self._snapshot = self._make_snapshot()
        except Exception as exc:  # a bug in the engine: fail every request, report not ready
            logger.exception("engine loop died")
            self._dead = f"engine failed: {type(exc).__name__}: {exc}"
            self._fail_all(self._dead)
        else:
            self._fail_all("engine stopped", reason=FinishReason.ABORT)
        self._grammars.close()
        self._snapshot = self._make_snapshot()
        # Requests submitted after the loop ended must still see an ending.
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                self._post(cmd[4], GenerationChunk([], finish_reason=FinishReason.ERROR,
                                                   error=self._dead or "engine stopped"))

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands; False when asked to stop."""
        try:  # while grammars compile, look for them often
            cmd = self._inbox.get(timeout=GRAMMAR_POLL_S if len(self._grammars) else 1.0) if block \
                else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "stop":
                return False
            if cmd[0] == "add":
                self._add(*cmd[1:])
            elif cmd[0] == "abort":
                self._abort(*cmd[1:])
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams, sink: _Sink) -> None:
        """A request with a grammar waits for it to compile (engine/grammar_prep.py), then `_admit`."""
        if params.grammar is None:
            self._admit(request_id, prompt, params, sink, None, None)
        elif (error := self._grammars.start(request_id, params.grammar, (request_id, prompt, params, sink))):
            self._post(sink, GenerationChunk([], finish_reason=FinishReason.ERROR, error=error))

    def _admit(self, request_id: str, prompt: list[int], params: SamplingParams, sink: _Sink, grammar,
               error: str | None) -> None:
        try:
            if error is not None:
                raise ValueError(error)
            self.core.add_request(prompt, params, request_id, grammar=grammar)
        except ValueError as exc:
            self._post(sink, GenerationChunk([], finish_reason=FinishReason.ERROR, error=str(exc)))
            return
        self._sinks[request_id] = sink

    def _abort(self, request_id: str, notify: bool) -> None:
        waiting = self._grammars.drop(request_id)
        sink = self._sinks.pop(request_id, None) if waiting is None else waiting[3]
        if sink is None:
            return
        if waiting is None:
            self.core.abort_request(request_id)
        if notify:
            self._post(sink, GenerationChunk([], finish_reason=FinishReason.ABORT, queue_time=sink.queue_time))

    def _dispatch(self, updates, step_start: float) -> None:
        # Queue time: submission until the first step that scheduled the request.
        for req_id, sink in self._sinks.items():
            if not sink.scheduled:
                req = self.core.scheduler.requests.get(req_id)
                if req is None or req.status != RequestStatus.WAITING or req.num_computed_tokens > 0:
                    sink.scheduled = True
                    sink.queue_time = max(0.0, step_start - sink.submit_time)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for u in updates:
            sink = self._sinks.get(u.req_id)
            if sink is None:
                continue
            chunk = GenerationChunk(list(u.new_token_ids), list(u.new_logprobs), u.finish_reason,
                                    queue_time=sink.queue_time, prompt_logprobs=u.prompt_logprobs,
                                    num_cached_tokens=u.num_cached_tokens)
            sink.queue_time = None  # delivered once
            if u.finish_reason is not None:
                del self._sinks[u.req_id]
            by_loop.setdefault(sink.loop, []).append((sink.queue, chunk))
        for loop, items in by_loop.items():
            self._call_in(loop, items)

    def _post(self, sink: _Sink, chunk: GenerationChunk) -> None:
        self._call_in(sink.loop, [(sink.queue, chunk)])

    def _call_in(self, loop: asyncio.AbstractEventLoop, items: list) -> None:
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # that loop is closed: nobody will read these; free the requests
            for q, _ in items:
                for req_id, sink in list(self._sinks.items()):
                    if sink.queue is q:
                        self._abort(req_id, notify=False)

    def _fail_all(self, message: str, reason: FinishReason = FinishReason.ERROR) -> None:
        for _, _, _, sink in self._grammars.clear():  # still waiting for their grammar
            self._post(sink, GenerationChunk([], finish_reason=reason,
                                             error=message if reason == FinishReason.ERROR else None))
        for req_id, sink in list(self._sinks.items()):
            try:
                self.core.abort_request(req_id)
            except Exception:  # the core may be broken; the streams still get their ending
                pass
            self._post(sink, GenerationChunk([], finish_reason=reason,
                                             error=message if reason == FinishReason.ERROR else None))
        self._sinks.clear()

    def _make_snapshot(self) -> InstanceInfo:
        s = self.core.stats()
        counters = {"num_preemptions": float(s.num_preemptions)}
        hits = getattr(self.core.block_manager, "num_hit_blocks", None)
        if hits is not None:
            counters["prefix_cache_hit_blocks"] = float(hits)
        ready = self.is_ready() if self._thread else False
        return InstanceInfo(name=INSTANCE_NAME, role=EngineRole.COLOCATED, ready=ready,
                            kv_blocks_free=s.kv_blocks_free, kv_blocks_total=s.kv_blocks_total,
                            num_running=s.num_running, num_waiting=s.num_waiting, counters=counters)
