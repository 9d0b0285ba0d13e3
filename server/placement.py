"""Where a request runs: a prefill and a decode instance, each chosen on its own.

Each role's instance is the least loaded (requests outstanding on it, then its queue). A decode
instance is chosen knowing the prefill already chosen: among equally loaded ones, the one this
prefill has handed off to least, so that with 2 P and 2 D every pair carries traffic rather than
the same two pairs forever (one bad link would then stall half the requests). A P->D pair whose
KV transfers keep failing (a broken or partitioned link between two otherwise healthy engines)
is avoided for a while: a breaker per pair, opened after `threshold` failures in a row and
closed again after `open_s` (or at the pair's next success, when nothing else was left).
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Collection

from server.engine_router import Instance

logger = logging.getLogger(__name__)


class Placement:
    def __init__(self, breaker_threshold: int = 3, breaker_open_s: float = 30.0) -> None:
        self.breaker_threshold, self.breaker_open_s = breaker_threshold, breaker_open_s
        self.pair_uses: Counter[tuple[str, str]] = Counter()
        self.failures_in_a_row: Counter[tuple[str, str]] = Counter()
        self.open_until: dict[tuple[str, str], float] = {}
        self.breaker_trips = 0
        # Rotates the start among equals, per role: one counter shared by P and D would advance twice a
        # request, so with 2 P every prefill would start from the same one.
        self._turns: defaultdict[str, itertools.count] = defaultdict(itertools.count)

    def pick(self, candidates: list[Instance], exclude: Collection[str] = (), prefill: str | None = None
             ) -> Instance | None:
        """The least loaded routable candidate not in `exclude`; for a decode instance (`prefill`
        given), one whose pair with that prefill has no open breaker, if there is any."""
        live = [i for i in candidates if i.routable and i.name not in exclude]
        if prefill is not None:
            now = time.monotonic()
            closed = [i for i in live if not self._is_open((prefill, i.name), now)]
            live = closed or live
        if not live:
            return None
        start = next(self._turns[live[0].role]) % len(live)
        rotated = live[start:] + live[:start]

        def load(i: Instance) -> tuple[int, int, int]:
            waiting = i.heartbeat.num_waiting if i.heartbeat else 0
            return len(i.outstanding), waiting, self.pair_uses[(prefill, i.name)] if prefill else 0

        return min(rotated, key=load)

    def handed_off(self, prefill: str, decode: str) -> None:
        self.pair_uses[(prefill, decode)] += 1

    def transfer_succeeded(self, prefill: str, decode: str) -> None:
        self.failures_in_a_row.pop((prefill, decode), None)
        self.open_until.pop((prefill, decode), None)

    def transfer_failed(self, prefill: str, decode: str) -> None:
        pair = (prefill, decode)
        self.failures_in_a_row[pair] += 1
        if self.failures_in_a_row[pair] >= self.breaker_threshold:
            self.failures_in_a_row.pop(pair)
            self.open_until[pair] = time.monotonic() + self.breaker_open_s
            self.breaker_trips += 1
            logger.warning("KV transfers from %s to %s failed %d times in a row: avoiding that pair for %g s",
                           prefill, decode, self.breaker_threshold, self.breaker_open_s)

    def _is_open(self, pair: tuple[str, str], now: float) -> bool:
        until = self.open_until.get(pair)
        if until is not None and until <= now:
            del self.open_until[pair]
            return False
        return until is not None

    def counters(self) -> dict[str, float]:
        return {"pd_pair_breaker_trips_total": float(self.breaker_trips)}
