"""A tiny HTTP health endpoint for one engine process (`--health-port`).

Engines speak only ZMQ, but container orchestrators probe over HTTP. This serves
`GET /health` from a daemon thread, from the engine's LoopWatch (engine/loop_watch.py): 200 while
the loop turns or runs a step (a step of any length is work: "busy", or "stalled" once far longer
than the engine's own recent steps, still 200 since an orchestrator that restarts it loses that
work), 503 while the engine is still loading its model, is leaving, or its loop stopped turning
outside any step for `max_stall_s`. Nothing here touches the engine's state beyond reading the
watch, so the probe can never slow down or break the loop.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from engine.loop_watch import LoopState, LoopWatch

logger = logging.getLogger(__name__)

# Between steps the loop ticks at least once per idle poll (engine/process.py IDLE_POLL_MS), so seconds without a
# tick outside a step means the loop itself is stuck.
DEFAULT_MAX_STALL_S = 5.0


class _Watched(Protocol):
    watch: LoopWatch
    stopping: bool


class HealthServer:
    """Serves /health for whichever engine is attached (none yet: 503 "starting")."""

    def __init__(self, port: int, host: str = "0.0.0.0", max_stall_s: float = DEFAULT_MAX_STALL_S,
                 role: str = "", name: str = "") -> None:
        self.engine: _Watched | None = None
        self.max_stall_s = max_stall_s
        self.role, self.name = role, name
        health = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.split("?", 1)[0] not in ("/health", "/healthz", "/livez", "/readyz"):
                    self._reply(404, {"status": "not found"})
                    return
                code, body = health.status()
                self._reply(code, body)

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, fmt: str, *args) -> None:
                # Probes arrive every few seconds; access logs would drown the engine's own log.
                logger.debug("health: " + fmt, *args)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="health", daemon=True)

    def start(self) -> HealthServer:
        self.thread.start()
        logger.info("health endpoint on port %d", self.port)
        return self

    def attach(self, engine: _Watched) -> None:
        """Called once the engine exists (the model is loaded and the loop is about to run)."""
        self.engine = engine

    def status(self) -> tuple[int, dict]:
        """(HTTP status, body) for a probe right now."""
        info = {"role": self.role, "name": self.name}
        engine = self.engine
        if engine is None:
            return 503, {"status": "starting", **info}
        if engine.stopping:
            return 503, {"status": "stopping", **info}
        watch, now = engine.watch, time.monotonic()
        state, age = watch.state(now), now - watch.last_tick
        if state in (LoopState.STARTING, LoopState.DRAINING):
            return 503, {"status": str(state), **info}
        busy = watch.busy_s(now)
        if not busy and age > self.max_stall_s:
            return 503, {"status": "stuck", "seconds_since_tick": round(age, 3), **info}
        return 200, {"status": str(state), "seconds_since_tick": round(age, 3), "step_running_s": round(busy, 3),
                     **info}

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
