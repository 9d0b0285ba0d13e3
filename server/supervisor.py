"""Keeps the engine processes of `pdserve serve` running: one that exits unexpectedly is started again.

The front end's failover covers the gap (the dead engine's requests resume on live instances, or
wait for one up to --resume-wait-s), and the restarted engine registers by itself. Restarts back
off (1 s, doubling to 30 s, reset once an engine has run for a minute) and are bounded per engine
(MAX_RESTARTS within WINDOW_S): an engine that keeps dying at start, a bad flag or a model that
does not fit, is left dead with an error in the log rather than restarted forever.

The engines die with the front end (server/procs.py, `start_tied`): an engine it restarted is tied
to the supervisor's thread, so that thread is also the one that stops them all at shutdown.
"""
from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

POLL_S = 0.5
FIRST_BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0
HEALTHY_AFTER_S = 60.0   # an engine that ran this long starts its backoff afresh
MAX_RESTARTS, WINDOW_S = 5, 600.0
STOP_GRACE_S = 5.0       # after SIGTERM, before SIGKILL


@dataclass
class Child:
    name: str
    start: Callable[[], subprocess.Popen]
    proc: subprocess.Popen
    started_at: float = field(default_factory=time.monotonic)
    backoff_s: float = FIRST_BACKOFF_S
    restarts: list[float] = field(default_factory=list)   # when it was restarted, within the window
    due_at: float | None = None                            # a restart is waiting for its backoff
    given_up: bool = False


class Supervisor:
    def __init__(self) -> None:
        self.children: list[Child] = []
        self.num_restarts = 0
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def add(self, name: str, start: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        child = Child(name, start, start())
        self.children.append(child)
        return child.proc

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop restarting engines and stop them: SIGTERM, SIGKILL what is left after STOP_GRACE_S.
        The supervisor's thread does it before it ends, since an engine it restarted gets SIGKILL the
        moment that thread ends, with no chance to leave cleanly (server/procs.py)."""
        self.stopping.set()
        if self._thread.is_alive():
            self._thread.join(STOP_GRACE_S + POLL_S * 4)
        else:  # never started, or already stopped
            self._stop_children()

    def counters(self) -> dict[str, float]:
        return {"engine_restarts_total": float(self.num_restarts)}

    def _run(self) -> None:
        while not self.stopping.wait(POLL_S):
            now = time.monotonic()
            for child in self.children:
                if child.given_up or child.proc.poll() is None:
                    continue
                if child.due_at is None:
                    self._schedule(child, now)
                elif now >= child.due_at and not self.stopping.is_set():
                    self._restart(child, now)
        self._stop_children()

    def _stop_children(self) -> None:
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for child in self.children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()

    def _schedule(self, child: Child, now: float) -> None:
        """It exited: restart it after its backoff, unless it used up its restarts."""
        if now - child.started_at > HEALTHY_AFTER_S:
            child.backoff_s = FIRST_BACKOFF_S
        child.restarts = [t for t in child.restarts if now - t < WINDOW_S]
        if len(child.restarts) >= MAX_RESTARTS:
            child.given_up = True
            logger.error("engine %s exited (status %s) and was restarted %d times in %g s: not again",
                         child.name, child.proc.returncode, MAX_RESTARTS, WINDOW_S)
            return
        child.due_at = now + child.backoff_s
        logger.error("engine %s exited unexpectedly (status %s); restarting it in %.0f s", child.name,
                     child.proc.returncode, child.backoff_s)

    def _restart(self, child: Child, now: float) -> None:
        child.proc, child.started_at, child.due_at = child.start(), now, None
        child.restarts.append(now)
        child.backoff_s = min(MAX_BACKOFF_S, child.backoff_s * 2)
        self.num_restarts += 1
        logger.info("engine %s restarted (pid %d)", child.name, child.proc.pid)
