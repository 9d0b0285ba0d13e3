"""A tiny HTTP health endpoint for one engine process (`--health-port`).

Engines speak only ZMQ, but container orchestrators probe over HTTP. This serves
`GET /health` from a daemon thread: 200 while the engine loop has turned recently
(`EngineProcess.last_tick` fresher than `max_stall_s`), 503 while the engine is still
loading its model, has stopped, or is stuck. Nothing here touches the engine's state
beyond reading one float, so the probe can never slow down or break the loop.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

logger = logging.getLogger(__name__)

# The loop ticks every 20 ms when idle and once per step when busy. A CPU step of a large
# batch can take a second or two, so "stuck" means several seconds without a tick.
DEFAULT_MAX_STALL_S = 5.0


class _Ticking(Protocol):
    last_tick: float
    stopping: bool


class HealthServer:
    """Serves /health for whichever engine is attached (none yet: 503 "starting")."""

    def __init__(self, port: int, host: str = "0.0.0.0", max_stall_s: float = DEFAULT_MAX_STALL_S,
                 role: str = "", name: str = "") -> None:
        self.engine: _Ticking | None = None
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

    def attach(self, engine: _Ticking) -> None:
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
        age = time.monotonic() - engine.last_tick
        if age > self.max_stall_s:
            return 503, {"status": "stalled", "seconds_since_tick": round(age, 3), **info}
        return 200, {"status": "ok", "seconds_since_tick": round(age, 3), **info}

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
