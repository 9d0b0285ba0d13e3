"""Liveness (issue 44): an engine busy with long steps, or a front end that stops for a while, is never
declared dead; engines outlive a dead front end and join the next one; `pdserve serve` keys its own
processes so that no other local process can join.

Every process is real (`python -m server.cli ...`), started here and killed by PID; the checks are on
/metrics counters and stream contents, the waits bounded."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import BUNDLED_MODEL, Reference
from pd_harness import ProcessGroup, free_port, wait_until

from server.procs import start_tied

REPO = Path(__file__).resolve().parents[1]
MODEL = str(BUNDLED_MODEL)
NEW = 6


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference(BUNDLED_MODEL)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(rng.randint(20, 40))] for _ in range(n)]


class FrontEnd:
    """`pdserve server` in its own process, engines connecting to `bind_addr`."""

    def __init__(self, tmp: Path, bind_addr: str, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"frontend-{self.port}.log"
        argv = [sys.executable, "-m", "server.cli", "server", "--bind-addr", bind_addr, "--port", str(self.port),
                "--mode", "pd", "--model", MODEL, "--max-model-len", "256", *flags]
        with open(self.log, "w") as log:
            self.proc = start_tied(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    def instances(self) -> dict[str, dict]:
        return {i["name"]: i for i in httpx.get(self.url + "/status.json", timeout=10).json()["instances"]}

    def wait_ready(self, names: set[str], timeout: float = 90) -> None:
        def ready() -> bool:
            try:
                return {n for n, i in self.instances().items() if i["ready"]} >= names
            except httpx.HTTPError:
                return False
        wait_until(ready, timeout, f"{sorted(names)} to register with {self.url}", interval=0.2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


async def stream(http: httpx.AsyncClient, url: str, prompt: list[int], progress: list[int], i: int) -> dict:
    body = {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    out = {"status": None, "tokens": [], "error": None, "finish_reason": None}
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = (await r.aread()).decode()
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]["message"]
                continue
            for choice in event["choices"]:
                out["tokens"] += choice.get("token_ids") or []
                progress[i] = len(out["tokens"])
                out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


async def stream_all(url: str, ps: list[list[int]], during=None, timeout: float = 120) -> list[dict]:
    progress = [0] * len(ps)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout)) as http:
        tasks = [asyncio.ensure_future(stream(http, url, p, progress, i)) for i, p in enumerate(ps)]
        if during is not None:
            await asyncio.wait_for(during(progress), timeout)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout)


def assert_exact(results: list[dict], ps: list[list[int]], reference: Reference) -> None:
    for i, (r, p) in enumerate(zip(results, ps)):
        assert r["status"] == 200 and r["error"] is None and r["finish_reason"] == "length", f"stream {i}: {r}"
        reference.assert_matches(p, r["tokens"], NEW, f"stream {i}")


def assert_nobody_died(front: FrontEnd) -> None:
    for name in ("pdserve:engines_declared_dead_total", "pdserve:requests_resumed_total",
                 "pdserve:requests_retried_total"):
        assert front.metric(name) == 0, f"{name} counted: {front.log.read_text()[-3000:]}"


def start_pair(tmp: Path, env: dict | None = None, *flags: str) -> ProcessGroup:
    group = ProcessGroup(tmp)
    group.add("prefill", "prefill-0", MODEL, "--max-model-len", "256", *flags, env=env)
    group.add("decode", "decode-0", MODEL, "--max-model-len", "256", *flags, env=env)
    return group


def test_steps_three_times_dead_after_are_work_not_deaths(tmp_path, reference):
    """Every engine step takes 3 x --dead-after-s: 8 streams complete exactly, with no failover,
    no resume and no retry (the heartbeat comes from the engine's link thread, whatever the step)."""
    group = start_pair(tmp_path, {"PDSERVE_DEBUG_STEP_DELAY": "3.0"})
    front = FrontEnd(tmp_path, group.server_addr, "--dead-after-s", "1.0")
    try:
        front.wait_ready({"prefill-0", "decode-0"})
        ps = prompts(8, 441)
        results = asyncio.run(stream_all(front.url, ps, timeout=240))
        assert_exact(results, ps, reference)
        assert_nobody_died(front)
    finally:
        front.kill()
        group.stop()


def test_a_front_end_paused_for_twice_dead_after_declares_no_engine_dead(tmp_path, reference):
    """SIGSTOP of the front end for 2 x --dead-after-s under load, then SIGCONT: it forgives its own
    pause instead of counting it against the engines: no death, no 503, every stream exact."""
    group = start_pair(tmp_path, {"PDSERVE_DEBUG_STEP_DELAY": "0.3"})
    front = FrontEnd(tmp_path, group.server_addr, "--dead-after-s", "1.0")
    try:
        front.wait_ready({"prefill-0", "decode-0"})
        ps = prompts(8, 442)

        async def pause_mid_stream(progress: list[int]) -> None:
            while not any(progress):
                await asyncio.sleep(0.02)
            os.kill(front.proc.pid, signal.SIGSTOP)
            await asyncio.sleep(2.0)
            os.kill(front.proc.pid, signal.SIGCONT)

        results = asyncio.run(stream_all(front.url, ps, during=pause_mid_stream))
        assert any(0 < len(r["tokens"]) for r in results)
        assert_exact(results, ps, reference)
        assert_nobody_died(front)
        assert "did not run for" in front.log.read_text()  # the pause was seen, and forgiven
    finally:
        os.kill(front.proc.pid, signal.SIGCONT)
        front.kill()
        group.stop()


def engine_health(port: int) -> tuple[int, dict]:
    r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    return r.status_code, r.json()


def test_engines_outlive_a_killed_front_end_and_join_the_next(tmp_path, reference):
    """kill -9 of the front end under load: the engines keep stepping (/health 200), join a new
    front end at the same address, serve through it, and leave within 5 s of SIGTERM."""
    ports = {"prefill-0": free_port(), "decode-0": free_port()}
    group = ProcessGroup(tmp_path)
    for role, name in (("prefill", "prefill-0"), ("decode", "decode-0")):
        group.add(role, name, MODEL, "--max-model-len", "256", "--health-port", str(ports[name]),
                  env={"PDSERVE_DEBUG_STEP_DELAY": "0.3"})
    front = FrontEnd(tmp_path, group.server_addr, "--dead-after-s", "1.0")
    second = None
    try:
        front.wait_ready(set(ports))

        async def kill_front_end(progress: list[int]) -> None:
            while not any(progress):
                await asyncio.sleep(0.02)
            front.kill()

        _run_ignoring_disconnects(front, kill_front_end)
        for _ in range(10):  # ~2 s of probes: each engine's loop still turns
            for name, port in ports.items():
                code, body = engine_health(port)
                assert code == 200 and body["status"] in ("ok", "busy"), (name, body)
            time.sleep(0.2)
        second = FrontEnd(tmp_path, group.server_addr, "--dead-after-s", "1.0")
        second.wait_ready(set(ports), timeout=60)
        ps = prompts(4, 444)
        assert_exact(asyncio.run(stream_all(second.url, ps)), ps, reference)
        for name in ports:
            group.procs[name].send_signal(signal.SIGTERM)
        for name in ports:
            assert group.procs[name].wait(5) == 0, f"{name} did not leave within 5 s of SIGTERM"
        wait_until(lambda: all(i["state"] in ("left", "dead") for i in second.instances().values()), 10,
                   "the front end to see both engines leave")
        assert second.metric("pdserve:engines_declared_dead_total") == 0  # they said they were leaving
    finally:
        front.kill()
        if second is not None:
            second.kill()
        group.stop()


def _run_ignoring_disconnects(front: FrontEnd, during) -> None:
    """Streams through `front` while `during` kills it: they end with connection errors, as they must."""
    async def main() -> None:
        progress = [0] * 8
        async with httpx.AsyncClient(timeout=httpx.Timeout(60)) as http:
            tasks = [asyncio.ensure_future(stream(http, front.url, p, progress, i))
                     for i, p in enumerate(prompts(8, 443))]
            await asyncio.wait_for(during(progress), 60)
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)

    asyncio.run(main())


def start_serve(port: int, env: dict, log: Path) -> subprocess.Popen:
    """`pdserve serve` of the bundled model (PD + MTP) in its own process group."""
    with open(log, "w") as out:
        return start_tied([sys.executable, "-m", "server.cli", "serve", "--mode", "pd", "--port", str(port),
                           "--model", MODEL, "--max-model-len", "256"], cwd=REPO, env=env, stdout=out,
                           stderr=subprocess.STDOUT, start_new_session=True)


def stop_serve(serve: subprocess.Popen) -> None:
    os.killpg(serve.pid, signal.SIGTERM)
    try:
        serve.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(serve.pid, signal.SIGKILL)
        serve.wait(10)


def test_serve_keys_its_own_processes_and_refuses_a_local_impostor(tmp_path):
    """`pdserve serve` with no cluster key given makes one for the processes it starts: a second local
    process that tries to register as an engine on its socket is refused, says why and exits non-zero,
    and never appears among the instances."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_CLUSTER_KEY")}
    log = tmp_path / "serve.log"
    serve = start_serve(port, env, log)
    impostor = None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: "engines connect to" in log.read_text(), 60, "pdserve serve to start")
        line = next(x for x in log.read_text().splitlines() if "engines connect to" in x)
        assert "with a fresh cluster key" in line, line
        addr = line.split("engines connect to ")[1].split()[0]

        def ready() -> bool:
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(ready, 90, "the engines of pdserve serve")
        impostor = subprocess.run([sys.executable, "-m", "server.cli", "decode", "--server-addr", addr, "--name",
                                   "impostor", "--model", MODEL, "--max-model-len", "256", "--register-timeout-s", "5",
                                   "--num-threads", "1"], cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=120)
        assert impostor.returncode == 3, impostor.stderr[-3000:]
        assert "cluster key" in impostor.stderr and "could not register" in impostor.stderr, impostor.stderr[-3000:]
        instances = httpx.get(url + "/status.json", timeout=10).json()["instances"]
        assert "impostor" not in {i["name"] for i in instances}
        refused = next(float(x.split()[-1]) for x in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                       if x.startswith("pdserve:engine_connections_refused_total "))
        assert refused >= 1
    finally:
        stop_serve(serve)


def test_the_stall_rule_scales_with_the_engine_and_the_step():
    """No history: only a very long first step is a stall (it may build kernels and prefill a long
    prompt). With a history of 0.2 s decode steps of 4 tokens, a 1024-token prefill chunk among them
    may take far longer (the prediction is per token), while a 4-token step of 30 s is a stall."""
    from engine.loop_watch import FIRST_STEPS_STALL_S, STALL_FLOOR_S, LoopState, LoopWatch

    tokens = [4]
    watch = LoopWatch(lambda: tokens[0])
    watch.tick()
    assert watch.stall_after_s() == FIRST_STEPS_STALL_S
    watch.recent.extend([(0.2, 4)] * 32)
    assert watch.stall_after_s() == STALL_FLOOR_S            # 10 x 0.2 s is under the floor
    watch.begin()
    watch.busy_since -= 30.0
    assert watch.state() == LoopState.STALLED
    tokens[0] = 1024                                          # 0.05 s a token x 1024 x 10 = 512 s
    assert abs(watch.stall_after_s() - 512.0) < 1e-6 and watch.state() == LoopState.BUSY
    watch.end(ran_model=True)
    assert watch.state() == LoopState.OK and watch.recent[-1][1] == 1024


def test_serve_restarts_an_engine_killed_under_load_and_its_streams_complete(tmp_path, reference):
    """kill -9 of `pdserve serve`'s decode engine mid-stream: the supervisor starts it again, the
    streams resume on it through failover and end exactly, and /metrics counts one restart."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PDSERVE_DEBUG_STEP_DELAY="0.2")
    serve = start_serve(port, env, tmp_path / "serve.log")
    front = FrontEnd.__new__(FrontEnd)  # its helpers, over this server
    front.url, front.log, front.proc = url, tmp_path / "serve.log", serve
    try:
        front.wait_ready({"prefill-0", "decode-0"})

        def decode_pid() -> int | None:
            found = subprocess.run(["pgrep", "-P", str(serve.pid), "-f", "--", "--name decode-0"], capture_output=True,
                                   text=True).stdout.split()
            return int(found[0]) if found else None

        victim = decode_pid()
        assert victim is not None
        ps = prompts(8, 445)

        async def kill_decode(progress: list[int]) -> None:
            while not any(progress):
                await asyncio.sleep(0.02)
            os.kill(victim, signal.SIGKILL)

        results = asyncio.run(stream_all(url, ps, during=kill_decode, timeout=180))
        assert_exact(results, ps, reference)
        assert front.metric("pdserve:engine_restarts_total") == 1
        assert front.metric("pdserve:requests_resumed_total") + front.metric("pdserve:requests_retried_total") >= 1
        assert decode_pid() not in (None, victim) and front.instances()["decode-0"]["ready"]
    finally:
        stop_serve(serve)


def test_a_front_end_starved_inside_a_turn_declares_no_engine_dead(tmp_path):
    """The router thread descheduled between reading an engine's heartbeats and judging them (the
    box at a load of dozens): the silence it sees then is its own, and its next turn forgives it,
    as it forgives a pause between turns."""
    import asyncio

    import zmq

    from engine import messages as msg
    from engine.types import EngineRole
    from server.engine_router import EngineRouter

    async def scenario() -> int:
        router = EngineRouter(f"ipc://{tmp_path}/fe", None, dead_after_s=0.5, stall_dead_after_s=900,
                              on_outputs=lambda arrivals: None)
        real_read, starved = router._read, []

        def read(now):
            real_read(now)
            if router.table and not starved:  # the first turn that read a heartbeat stalls
                starved.append(now)
                time.sleep(1.5)

        router._read = read
        router.start()
        engine = zmq.Context.instance().socket(zmq.DEALER)
        engine.setsockopt(zmq.IDENTITY, b"decode-0")
        engine.setsockopt(zmq.LINGER, 0)
        engine.connect(f"ipc://{tmp_path}/fe")
        beat = msg.Heartbeat("decode-0", EngineRole.DECODE, "", 1, 1, 0, 0, {})
        try:
            for _ in range(40):  # every 0.1 s for 4 s, across the starved turn
                engine.send(msg.encode(beat))
                await asyncio.sleep(0.1)
            assert starved, "the router never read a heartbeat"
            return router.deaths
        finally:
            engine.close(0)
            router.stop()

    assert asyncio.run(scenario()) == 0
