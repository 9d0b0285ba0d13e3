"""Start prefill/decode/colocated engines for tests: in-process threads (for monkeypatching) or
real processes (for kill -9), plus a RemoteEngineClient to drive them without HTTP."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from engine.config import EngineConfig, KVTransferConfig, ModelConfig
from engine.process import EngineProcess
from engine.types import SamplingParams
from server.pd_client import RemoteEngineClient
from server.procs import start_tied
from server.protocol import EngineUnavailableError

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range. A port taken from that range
    (bind to :0) can, before whoever was handed it binds it, become the local port of some
    outgoing connection, and the bind then fails with 'Address already in use'."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        port = random.randrange(max(1024, low - 20000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


class ThreadedEngines:
    """Engines as threads of this process; addresses are ipc:// in a temp dir."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.server_addr = f"ipc://{tmp}/frontend-{uuid.uuid4().hex[:6]}"
        self.procs: dict[str, EngineProcess] = {}
        self.threads: list[threading.Thread] = []

    def add(self, role: str, name: str, config: EngineConfig, kv: KVTransferConfig | None = None,
            **kwargs) -> EngineProcess:
        """`kwargs`: EngineProcess's other arguments (cluster_key, ...)."""
        kv = kv or KVTransferConfig()
        if role == "prefill" and not kv.addr:
            kv = dataclasses.replace(kv, addr=f"ipc://{self.tmp}/{name}-kv-{uuid.uuid4().hex[:6]}")
        proc = EngineProcess(role, config, name, self.server_addr, kv, **kwargs)
        self.procs[name] = proc
        thread = threading.Thread(target=proc.run, daemon=True, name=name)
        self.threads.append(thread)
        return proc

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        for p in self.procs.values():
            p.stopping = True
        for t in self.threads:
            t.join(timeout=10)


def client_for(server_addr: str, model: str, mode: str, max_model_len: int, **kwargs) -> RemoteEngineClient:
    cfg = ModelConfig.from_dir(model)
    return RemoteEngineClient(server_addr, mode, max_model_len, cfg.vocab_size, cfg.eos_token_ids, **kwargs)


async def generate_all(client: RemoteEngineClient, prompts: list[list[int]], params: SamplingParams,
                       concurrency: int = 8, timeout: float = 120.0) -> list[dict]:
    """Run every prompt through the client; returns per prompt {tokens, finish_reason, error}."""
    sem = asyncio.Semaphore(concurrency)

    async def one(prompt: list[int]) -> dict:
        async with sem:
            tokens: list[int] = []
            result = {"tokens": tokens, "finish_reason": None, "error": None}
            try:
                async for chunk in client.generate(uuid.uuid4().hex, prompt, params):
                    tokens.extend(chunk.token_ids)
                    if chunk.finish_reason:
                        result["finish_reason"], result["error"] = chunk.finish_reason, chunk.error
            except EngineUnavailableError as e:  # the HTTP layer answers 503
                result["finish_reason"], result["error"] = "error", f"unavailable: {e}"
            return result

    return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout)


async def wait_ready(client: RemoteEngineClient, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not client.is_ready():
        if time.monotonic() > deadline:
            raise TimeoutError("engines did not become ready")
        await asyncio.sleep(0.05)


async def wait_blocks_free(client: RemoteEngineClient, timeout: float = 5.0) -> None:
    """Every live instance reports free == total (no leaked KV blocks) within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        infos = [i for i in client.instances() if i.ready]
        leaks = {i.name: (i.kv_blocks_free, i.kv_blocks_total) for i in infos if i.kv_blocks_free != i.kv_blocks_total}
        if infos and not leaks:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks not all free after {timeout}s: {leaks}")
        await asyncio.sleep(0.1)


# Waits for its stdin (a pipe from the test) to close, which it does however the test ends, then
# SIGKILLs the process group named on its command line.
_GROUP_GUARD = """
import os, signal, sys
sys.stdin.read()
try:
    os.killpg(int(sys.argv[1]), signal.SIGKILL)
except ProcessLookupError:
    pass
"""


def guard_group(pgid: int) -> subprocess.Popen:
    """A process outside this one that SIGKILLs process group `pgid` once this process is gone, for a
    group whose leader does not tie its own children (server.procs.start_tied): `make serve` starts the
    front end, and make's death passes nothing on to it. Kill the guard once the group is stopped."""
    return subprocess.Popen([sys.executable, "-c", _GROUP_GUARD, str(pgid)], stdin=subprocess.PIPE,
                            start_new_session=True)


class ProcessGroup:
    """Engine processes started with `python -m server.cli ROLE ...`, killed by PID at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.server_addr = f"ipc://{tmp}/frontend-{uuid.uuid4().hex[:6]}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}

    def add(self, role: str, name: str, model: str, *flags: str, env: dict | None = None) -> None:
        argv = [sys.executable, "-m", "server.cli", role, "--model", model, "--name", name,
                "--server-addr", self.server_addr, "--num-threads", "1", *flags]
        if role == "prefill":
            argv += ["--kv-addr", f"ipc://{self.tmp}/{name}-kv-{uuid.uuid4().hex[:6]}"]
        self.argv[name] = argv
        self.start(name, env)

    def start(self, name: str, env: dict | None = None) -> None:
        full_env = dict(os.environ, PDSERVE_LOG_LEVEL="WARNING", **(env or {}))
        self.procs[name] = start_tied(self.argv[name], cwd=REPO, env=full_env, start_new_session=True)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def pause(self, name: str) -> None:
        """SIGSTOP: the process does nothing at all (no step, no heartbeat, no KV pull) until resumed."""
        os.killpg(self.procs[name].pid, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        for name in self.procs:
            self.kill(name)


@contextmanager
def running_client(client: RemoteEngineClient):
    """Runs the client's event loop in a background thread; yields a `run(coro)` helper."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro, timeout: float = 180.0):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    run(client.start())
    try:
        yield run
    finally:
        run(client.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
