"""What an engine loop is doing right now, readable from other threads (the heartbeat, /health).

Liveness is judged from here, not from the loop's own sends: the loop may spend seconds (a
0.5B-class model's prefill on a CPU) to minutes (a 70B model's) in one step, and that is work, not
death. The loop writes three facts (it turned, a step began, the step ended); readers derive its
state from them:

- STARTING: the model is loaded but the loop has not turned yet: the front end sends it no work;
- OK: the loop turned recently and is between steps (or idle);
- BUSY: inside a step that is not (yet) far longer than this engine's own recent steps;
- STALLED: inside a step far longer than them: `stall_after_s()`. Reported, not fatal: the front
  end treats a stall as a death only after its own, much longer `--stall-dead-after-s`;
- DRAINING: SIGTERM was received; the engine hands its work back and leaves.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from enum import StrEnum

import numpy as np

# A step is stalled when it runs longer than STALL_FACTOR x what the engine's own recent steps
# predict for it, and never before STALL_FLOOR_S. The prediction is the larger of the p99 of recent
# step times and the p99 of recent seconds per scheduled token times this step's tokens: it scales
# with the model and the machine (a toy model steps in milliseconds, a 0.5B one on a CPU in
# seconds, a 70B one in tens of seconds) and with the step (a prefill chunk of 1024 tokens among
# decode steps of 8 is not a stall; per-token costs are highest in small decode steps, so the
# prediction for a large chunk errs long, never short). The factor absorbs a busy machine; the
# floor keeps milliseconds-long histories from calling a GC pause or a page-fault burst a stall.
STALL_FACTOR = 10.0
STALL_FLOOR_S = 10.0
# Until the engine has a history, a step may also build kernels and prefill a long prompt: the
# first steps of a large model are the longest it will ever take.
MIN_HISTORY = 8
FIRST_STEPS_STALL_S = 300.0
HISTORY = 256


class LoopState(StrEnum):
    STARTING = "starting"
    OK = "ok"
    BUSY = "busy"
    STALLED = "stalled"
    DRAINING = "draining"


class LoopWatch:
    """Written by the engine loop's thread only; read by any (floats and a deque: no lock needed
    under the GIL, and a reader that sees a value one step old is still right enough).
    `step_tokens()` tells how many tokens the step in progress scheduled (0 before it knows)."""

    def __init__(self, step_tokens: Callable[[], int] = lambda: 0) -> None:
        self.step_tokens = step_tokens
        self.last_tick = time.monotonic()
        self.started = False          # the loop has turned at least once
        self.draining = False
        self.busy_since = 0.0         # monotonic start of the step in progress; 0 between steps
        # (seconds, tokens scheduled) of recent steps that ran the model
        self.recent: deque[tuple[float, int]] = deque(maxlen=HISTORY)

    # -- the loop's side -----------------------------------------------------------------

    def tick(self) -> None:
        self.last_tick = time.monotonic()
        self.started = True

    def begin(self) -> None:
        self.busy_since = time.monotonic()

    def end(self, ran_model: bool) -> None:
        if ran_model:
            self.recent.append((time.monotonic() - self.busy_since, max(1, self.step_tokens())))
        self.busy_since = 0.0

    # -- readers -------------------------------------------------------------------------

    def busy_s(self, now: float | None = None) -> float:
        since = self.busy_since
        return 0.0 if not since else (time.monotonic() if now is None else now) - since

    def step_p99_s(self) -> float:
        recent = list(self.recent)
        return float(np.percentile([s for s, _ in recent], 99)) if recent else 0.0

    def stall_after_s(self) -> float:
        recent = list(self.recent)
        if len(recent) < MIN_HISTORY:
            return FIRST_STEPS_STALL_S
        seconds = np.array([s for s, _ in recent])
        per_token = np.percentile(seconds / np.array([t for _, t in recent]), 99)
        predicted = max(float(np.percentile(seconds, 99)), float(per_token) * self.step_tokens())
        return max(STALL_FLOOR_S, STALL_FACTOR * predicted)

    def state(self, now: float | None = None) -> LoopState:
        if self.draining:
            return LoopState.DRAINING
        if not self.started:
            return LoopState.STARTING
        busy = self.busy_s(now)
        if not busy:
            return LoopState.OK
        return LoopState.STALLED if busy > self.stall_after_s() else LoopState.BUSY
