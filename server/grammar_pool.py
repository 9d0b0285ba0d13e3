"""Grammar checks for the front end: a spec is compiled in a worker process, off the event loop,
under a size and a time budget, and the verdict is cached by the spec's digest.

Why processes: xgrammar releases the GIL while it compiles, so a thread would not stall the event
loop, but a thread cannot be stopped: a spec that compiles for minutes would keep a core busy for
minutes after its client got the 400. A worker over budget is killed instead, and a fresh one
starts on the next use (its start-up is not counted against any spec's budget). The worker
compiles what an engine will compile (the same vocabulary, worker/structured.py), so a spec that
passes here costs the engines about as much, on a thread of their own (engine/grammar_prep.py).
Refusals are cached too: the same bomb sent again is refused at once.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection

from engine.grammar import (
    DEFAULT_GRAMMAR_TIMEOUT_S,
    DEFAULT_MAX_GRAMMAR_BYTES,
    check_refs,
    spec_compiler,
    spec_key,
    spec_size,
)
from engine.types import GrammarSpec
from server.errors import APIError

logger = logging.getLogger(__name__)

# A worker loads the tokenizer and xgrammar before it takes a spec; a machine busy enough to need
# longer than this is not going to compile anything in time either.
_STARTUP_S = 120.0
_CACHE_SIZE = 1024


@dataclass(frozen=True)
class _Vocab:
    model_dir: str | None  # None: no tokenizer, check the grammar alone
    vocab_size: int
    stop_token_ids: tuple[int, ...]


class _Unavailable(Exception):
    """The worker could not start (not the spec's fault: nothing is cached)."""


def _serve(conn: Connection, vocab: _Vocab) -> None:
    """A worker process: answer each spec with None (it compiles) or the reason it does not."""
    try:
        compile_spec = spec_compiler(vocab.model_dir, vocab.vocab_size, vocab.stop_token_ids)
    except ValueError as exc:
        conn.send(str(exc))
        return
    conn.send(None)  # ready
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        try:
            compile_spec(spec)
            conn.send(None)
        except ValueError as exc:
            conn.send(str(exc))


class _Worker:
    """One worker process; its methods block (they run on the checker's threads)."""

    def __init__(self, vocab: _Vocab) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork: the front end runs threads and ZMQ
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, vocab), daemon=True, name="pdserve-grammar")
        self.proc.start()
        child.close()
        self.ready = False

    def compile(self, spec: GrammarSpec, budget_s: float) -> str | None:
        """None, or why `spec` does not compile; TimeoutError past `budget_s`."""
        if not self.ready:
            if not self.conn.poll(_STARTUP_S):
                raise _Unavailable(f"the grammar checker did not start in {_STARTUP_S:.0f} s")
            if (error := self._recv()) is not None:
                raise _Unavailable(error)
            self.ready = True
        try:
            self.conn.send(spec)
        except OSError:  # it died while idle (killed from outside): not this spec's fault
            raise _Unavailable(f"the grammar worker exited (status {self.proc.exitcode})") from None
        if not self.conn.poll(budget_s):
            raise TimeoutError
        return self._recv()

    def _recv(self) -> str | None:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            code = self.proc.exitcode
            return f"the grammar compiler failed on it (worker exit status {code})"

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


class GrammarChecker:
    """`await check(spec, param)`: the spec, or a 400 naming `param` when it is over `max_bytes`,
    holds a non-local `$ref`, does not compile, or takes longer than `timeout_s` to compile.
    `workers` processes at most, started on first use."""

    def __init__(self, model_dir: str | None, vocab_size: int, stop_token_ids: Sequence[int], *,
                 timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S, max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
                 workers: int = 1) -> None:
        self.vocab = _Vocab(model_dir, vocab_size, tuple(stop_token_ids))
        self.timeout_s, self.max_bytes = timeout_s, max_bytes
        self.compiles = 0        # specs compiled by a worker (cache misses)
        self.over_budget = 0     # of them, killed for running past timeout_s
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-check")
        self._slots = asyncio.Semaphore(workers)
        self._idle: list[_Worker] = []
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()
        self._pending: dict[str, asyncio.Future] = {}

    async def check(self, spec: GrammarSpec, param: str) -> GrammarSpec:
        size = spec_size(spec)
        if size > self.max_bytes:
            raise APIError(400, f"{param}: the grammar is {size} bytes; at most {self.max_bytes} are allowed "
                                "(the server's --max-grammar-bytes)", param=param)
        try:  # a walk over the parsed spec, linear in its size (bounded just above): no need for a worker
            check_refs(spec)
        except ValueError as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from None
        key = spec_key(spec)
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            error = self._verdicts[key]
        else:
            pending = self._pending.get(key)
            if pending is None:  # one compile per spec, however many requests wait for it
                pending = self._pending[key] = asyncio.ensure_future(self._compile(key, spec))
                pending.add_done_callback(lambda _: self._pending.pop(key, None))
            error = await asyncio.shield(pending)
        if error is not None:
            raise APIError(400, f"{param}: {error}", param=param)
        return spec

    async def _compile(self, key: str, spec: GrammarSpec) -> str | None:
        async with self._slots:
            worker = self._idle.pop() if self._idle else None
            if worker is not None and not worker.proc.is_alive():
                worker.kill()  # it is gone already: nothing to wait for
                worker = None
            loop = asyncio.get_running_loop()
            try:
                worker = worker or await loop.run_in_executor(self._threads, _Worker, self.vocab)
                self.compiles += 1
                error = await loop.run_in_executor(self._threads, worker.compile, spec, self.timeout_s)
            except TimeoutError:
                self.over_budget += 1
                await loop.run_in_executor(self._threads, worker.kill)
                # Its successor starts now, so that the next spec does not wait for it to load.
                self._idle.append(await loop.run_in_executor(self._threads, _Worker, self.vocab))
                error = (f"the grammar did not compile within {self.timeout_s:g} s "
                         "(the server's --grammar-timeout-s); simplify the schema")
            except _Unavailable as exc:
                await loop.run_in_executor(self._threads, worker.kill)
                logger.error("grammar checker: %s", exc)
                raise APIError(503, f"structured output is unavailable: {exc}", type="server_error",
                               code="grammar_unavailable") from None
            else:
                if worker.proc.is_alive():
                    self._idle.append(worker)
                else:  # it died on this spec (the verdict says so); the next spec gets a fresh one
                    await loop.run_in_executor(self._threads, worker.kill)
        self._verdicts[key] = error
        if len(self._verdicts) > _CACHE_SIZE:
            self._verdicts.popitem(last=False)
        return error

    def close(self) -> None:
        for worker in self._idle:
            worker.kill()
        self._idle.clear()
        self._threads.shutdown(wait=False, cancel_futures=True)
