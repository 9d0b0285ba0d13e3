"""pdserve's HTTP API in one process, as `pdserve serve` wires it (engine processes behind a
RemoteEngineClient, the FastAPI app in front), but with the engines as threads so that a test
starts in seconds and can read the engines' state: colocated, or one prefill + one decode."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pd_harness import ThreadedEngines, client_for, wait_until
from test_server_api import ServerThread

from engine.config import EngineConfig
from engine.process import EngineProcess
from server.app import build_app


@dataclass
class HTTPServed:
    url: str
    engines: dict[str, EngineProcess]  # by instance name: "colocated-0", or "prefill-0" and "decode-0"
    app: Any  # the FastAPI app (its state: app.state.serving)

    def hit_blocks(self, name: str) -> int:
        """Prefix-cache hits (blocks) the instance has handed out so far."""
        return self.engines[name].core.block_manager.num_hit_blocks


@contextmanager
def served(tmp: Path, mode: str, tokenizer, model_name: str, app_options: dict | None = None,
           **config) -> Iterator[HTTPServed]:
    """`mode` "pd" or "colocated"; `app_options`: build_app's keyword arguments; `config`:
    EngineConfig fields for every engine."""
    engines = ThreadedEngines(tmp)
    roles = ("prefill", "decode") if mode == "pd" else ("colocated",)
    for role in roles:
        engines.add(role, f"{role}-0", EngineConfig(num_threads=1, **config))
    engines.start()
    client = client_for(engines.server_addr, config["model"], mode, config["max_model_len"])
    try:
        with ServerThread(build_app(client, tokenizer, model_name, **(app_options or {}))) as server:
            def ready() -> bool:
                return httpx.get(f"{server.url}/health", timeout=2).status_code == 200
            wait_until(ready, 60, "the engines to register", interval=0.1)
            yield HTTPServed(server.url, engines.procs, server.app)
            assert server.app.state.internal_errors == 0
    finally:
        engines.stop()
