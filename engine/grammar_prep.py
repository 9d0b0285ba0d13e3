"""Grammars compiled before admission, on a thread of the engine process, never inside a step.

A request whose sampling parameters carry a grammar waits here, outside the scheduler, while one
background thread compiles its grammar: xgrammar releases the GIL while it builds and compiles, so
the loop keeps stepping the other requests and the link keeps heart-beating. Each turn the loop
takes the finished ones: it queues each with its compiled grammar, or fails that one request when
its grammar does not compile. An abort drops a request that is still waiting. One thread: compiles
take turns, and they never take more than one core from the engine's steps.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from engine.types import GrammarSpec

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    item: Any             # what the caller handed in with the request (an engine process: its Submit)
    grammar: Any          # the compiled grammar; None when `error` says why there is none
    error: str | None


@dataclass
class _Waiting:
    item: Any
    transfer_id: str
    future: Future


class GrammarPrep:
    def __init__(self, compile_grammar: Callable[[GrammarSpec], Any]) -> None:
        self._compile = compile_grammar
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-prep")
        self._waiting: dict[str, _Waiting] = {}  # by request id, oldest first

    def __len__(self) -> int:
        return len(self._waiting)

    def start(self, req_id: str, spec: GrammarSpec, item: Any, transfer_id: str = "") -> str | None:
        """Compile `spec` in the background; `ready` hands `item` back with the result. An error (the
        request is not taken) or None."""
        if req_id in self._waiting:
            return f"request_id {req_id!r} is already in use"
        self._waiting[req_id] = _Waiting(item, transfer_id, self._pool.submit(self._compile, spec))
        return None

    def drop(self, req_id: str, transfer_id: str | None = None) -> Any:
        """An abort of a request still waiting for its grammar (`transfer_id`: only that attempt's):
        its item, or None when no such request waits here."""
        entry = self._waiting.get(req_id)
        if entry is None or (transfer_id is not None and entry.transfer_id != transfer_id):
            return None
        del self._waiting[req_id]
        entry.future.cancel()  # a compile already running finishes (and is cached); its result is dropped
        return entry.item

    def clear(self) -> list[Any]:
        """Drop every waiting request (the engine stops); their items."""
        items = [entry.item for entry in self._waiting.values()]
        for entry in self._waiting.values():
            entry.future.cancel()
        self._waiting.clear()
        return items

    def ready(self) -> list[Prepared]:
        """The requests whose compile has ended, in arrival order."""
        out = []
        for req_id, entry in list(self._waiting.items()):
            if not entry.future.done():
                continue
            del self._waiting[req_id]
            try:
                out.append(Prepared(entry.item, entry.future.result(), None))
            except Exception as exc:  # whatever the compiler raised fails this request, not the engine
                if not isinstance(exc, ValueError):
                    logger.exception("compiling the grammar of request %s failed", req_id)
                out.append(Prepared(entry.item, None, str(exc) if isinstance(exc, ValueError)
                                    else f"sampling_params.grammar: cannot compile: {type(exc).__name__}: {exc}"))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
