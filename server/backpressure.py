"""Backpressure from a slow reader: the queue between a stream's choices and its writer, bounded.

The writer waits on the client's socket; while it waits the choices keep emitting. Without a
bound a client that never reads would make the front end buffer everything the engine generates.
Past the bound the request is aborted (the engine frees its KV through the ordinary abort path)
and the connection closed; `pdserve:streams_aborted_slow_reader` counts it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


def backlog_weight(item) -> int:
    """A queued (choice, delta) in entries: each token and each of its top-logprob alternatives."""
    choice, delta = item
    if delta is None:
        return 1
    return max(1, len(delta.token_ids)) * (1 + (choice.params.logprobs or 0))


class StreamBacklog:
    """The queue of one stream's (choice, delta) events. `put_nowait` never fails (emitting never
    raises); once `arm`ed (the writer has started), more than `bound` entries put while the writer
    takes nothing -- it waits on a client that does not read -- call `on_overflow` once and set
    `overflowed`. Before that the queue fills while the stream waits for its slowest choice's first
    event, which is no sign of a slow reader."""

    def __init__(self, bound: int, on_overflow: Callable[[], None]) -> None:
        self.bound = bound
        self.on_overflow = on_overflow
        self.overflowed = asyncio.Event()
        self.armed = False
        self.unread = 0  # entries put since the writer last took one
        self._queue: asyncio.Queue = asyncio.Queue()

    def arm(self) -> None:
        self.armed, self.unread = True, 0

    def put_nowait(self, item) -> None:
        if self.overflowed.is_set():
            return  # the stream is being torn down: nothing more will be written
        self._queue.put_nowait(item)
        self.unread += backlog_weight(item)
        if self.armed and self.unread > self.bound:
            self.overflowed.set()
            logger.warning("a stream's client stopped reading (%d entries unwritten, bound %d): aborting it",
                           self.unread, self.bound)
            self.on_overflow()

    async def get(self):
        item = await self._queue.get()
        self.unread = 0
        return item
