"""Multi-host PD over real TCP (issue 44): the front end, prefill and decode engines each in a
network namespace of their own (tests/netns_harness.py), with the cluster key.

Two bridges: "front" (engines <-> front end) and "kv" (prefill <-> decode KV ports), so a fault
on the KV network leaves every engine's link to the front end (its heartbeats) alone. A
partition is iptables DROP rules on one decode instance's KV interface, both ways (silent: no
resets); a slow link is a token-bucket qdisc on a prefill's KV interface.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import random_prompts
from netns_harness import Netns, netns_skip_reason

REPO = Path(__file__).resolve().parents[1]
VOCAB = 384
FE = {"front": "10.213.1.2"}
HTTP_PORT, ENGINE_PORT, KV_PORT = 8000, 5500, 5700
NODES = {"p0": 10, "p1": 11, "d0": 20, "d1": 21, "rogue-d": 30, "rogue-p": 31}

pytestmark = [pytest.mark.skipif(netns_skip_reason() is not None, reason=str(netns_skip_reason())),
              pytest.mark.timeout(150)]


def addresses(node: str) -> dict[str, str]:
    return {"front": f"10.213.1.{NODES[node]}", "kv": f"10.213.2.{NODES[node]}"}


class Cluster:
    """A front end and engines started with `python -m server.cli ...` in their own namespaces."""

    def __init__(self, tmp: Path, model: str) -> None:
        self.tmp, self.model = tmp, model
        self.key_file = tmp / "cluster.key"
        subprocess.run([sys.executable, "-m", "server.cli", "keygen", str(self.key_file)], cwd=REPO, check=True,
                       timeout=60, capture_output=True)
        self.net = Netns()
        self.procs: dict[str, subprocess.Popen] = {}
        self.net.bridge("front")
        self.net.bridge("kv")
        self.net.node("fe", FE)
        self.url = f"http://{FE['front']}:{HTTP_PORT}"

    def env(self, key_file: Path | None, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        env.update(PYTHONPATH=str(REPO), PDSERVE_LOG_LEVEL="INFO", PDSERVE_ENFORCE_EAGER="1", **(extra or {}))
        if key_file is not None:
            env["PDSERVE_CLUSTER_KEY_FILE"] = str(key_file)
        return env

    def start_front_end(self) -> None:
        # --local-prefill-above 0: every prompt is prefilled on a prefill host, so its KV crosses the network.
        argv = [sys.executable, "-m", "server.cli", "server", "--model", self.model, "--mode", "pd",
                "--bind-addr", f"tcp://{FE['front']}:{ENGINE_PORT}", "--host", FE["front"], "--port", str(HTTP_PORT),
                "--num-threads", "1", "--local-prefill-above", "0"]
        self.procs["fe"] = self.net.popen("fe", argv, self.tmp / "fe.log", self.env(self.key_file), REPO)

    def start_engine(self, role: str, name: str, *flags: str, env: dict[str, str] | None = None,
                     key_file: Path | None | str = "cluster") -> subprocess.Popen:
        self.net.node(name, addresses(name))
        kv_ip = addresses(name)["kv"]
        argv = [sys.executable, "-m", "server.cli", role, "--model", self.model, "--name", name,
                "--server-addr", f"tcp://{FE['front']}:{ENGINE_PORT}", "--num-threads", "1", *flags]
        if role == "prefill":
            argv += ["--kv-addr", f"tcp://{kv_ip}:{KV_PORT}", "--kv-advertise", f"tcp://{kv_ip}:{KV_PORT}"]
        key = self.key_file if key_file == "cluster" else key_file
        self.procs[name] = self.net.popen(name, argv, self.tmp / f"{name}.log", self.env(key, env), REPO)  # type: ignore[arg-type]
        return self.procs[name]

    def status(self) -> dict:
        return self.net.http("fe", lambda: httpx.get(f"{self.url}/status.json", timeout=5).json(), timeout=10)

    def instances(self) -> dict[str, dict]:
        try:
            return {i["name"]: i for i in self.status()["instances"]}
        except (httpx.HTTPError, OSError, ValueError):
            return {}

    def wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None and not name.startswith("rogue"):
                    raise AssertionError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
            if predicate():
                return
            time.sleep(0.3)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}; fe log:\n{self.log_tail('fe')}")

    def wait_ready(self, names: list[str], timeout: float = 90) -> None:
        self.wait(lambda: all(self.instances().get(n, {}).get("ready") for n in names), timeout,
                  f"{names} to be ready")

    def wait_blocks_free(self, timeout: float = 20) -> None:
        def free() -> bool:
            infos = self.instances().values()
            return bool(infos) and all(i["kv_blocks_free"] == i["kv_blocks_total"] for i in infos)

        self.wait(free, timeout, "every instance's KV blocks to be free (no leak)")

    def stream(self, prompts: list[list[int]], max_tokens: int, timeout: float = 120) -> list[dict]:
        """Every prompt as a streaming completion at once; per prompt its tokens, each chunk's
        (monotonic time, token count) and any error."""
        def one(prompt: list[int]) -> dict:
            body = {"model": Path(self.model).name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True, "stream": True}
            out: dict = {"tokens": [], "times": [], "error": None, "finish_reason": None}
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=timeout) as r:
                if r.status_code != 200:
                    out["error"] = f"HTTP {r.status_code}: {r.read().decode()[:300]}"
                    return out
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        out["error"] = chunk["error"]
                        continue
                    choice = chunk["choices"][0]
                    ids = choice.get("token_ids") or []
                    if ids:
                        out["tokens"] += ids
                        out["times"].append((time.monotonic(), len(ids)))
                    out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
            return out

        with self.net.pool("fe", len(prompts)) as pool:
            futures = [pool.submit(one, p) for p in prompts]
            return [f.result(timeout + 10) for f in futures]

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.tmp / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"

    def close(self) -> None:
        self.net.close()


def assert_exact(references, prompts: list[list[int]], results: list[dict], max_tokens: int) -> None:
    for i, (prompt, r) in enumerate(zip(prompts, results)):
        assert r["error"] is None and r["finish_reason"] == "length", (i, r["error"], r["finish_reason"])
        references["qwen2"].assert_matches(prompt, r["tokens"], max_tokens, f"stream {i}")


@pytest.fixture(scope="module")
def cluster(checkpoints, tmp_path_factory):
    """2 prefill and 2 decode engines, each on its own host. The prefills are slowed down
    (PDSERVE_DEBUG_STEP_DELAY, small chunks) so that a fault can catch KV transfers in flight;
    p0 streams the KV layer by layer, p1 sends it once the prefill is over."""
    c = Cluster(tmp_path_factory.mktemp("multihost"), str(checkpoints["qwen2"]))
    try:
        c.start_front_end()
        for name, mode in (("p0", "layerwise"), ("p1", "after-prefill")):  # both ways of shipping the KV
            c.start_engine("prefill", name, "--max-model-len", "512", "--max-num-batched-tokens", "48",
                           "--kv-transfer-mode", mode, "--kv-layerwise-min-tokens", "0",
                           env={"PDSERVE_DEBUG_STEP_DELAY": "0.1"})
        for name in ("d0", "d1"):
            c.start_engine("decode", name, "--max-model-len", "512")
        c.wait_ready(["p0", "p1", "d0", "d1"])
        yield c
    finally:
        c.close()


def test_sixteen_streams_across_hosts_match_the_reference(cluster, references):
    prompts = random_prompts(16, 20, 200, VOCAB, 4401)
    start = time.monotonic()
    results = cluster.stream(prompts, 16)
    print(f"\n16 streams over 2 P + 2 D hosts: {time.monotonic() - start:.1f} s")
    assert_exact(references, prompts, results, 16)
    infos = cluster.instances()
    assert infos["d0"]["transfers"] + infos["d1"]["transfers"] >= 16
    cluster.wait_blocks_free()


def test_kv_partition_heals_and_the_stuck_streams_continue(cluster, references):
    """d0's KV link is cut for 20 s while prefills stream KV to it, then restored: every stream
    completes exactly, the stuck ones continue within seconds of the link's return, no block leaks."""
    prompts = random_prompts(16, 150, 300, VOCAB, 4402)
    with cluster.net.pool("fe", 1) as bg:
        pending = bg.submit(cluster.stream, prompts, 16, 120)
        time.sleep(2.5)  # the slowed prefills are still streaming layers to both decode instances
        with cluster.net.cut("d0", "kv"):
            down = time.monotonic()
            # What had reached d0 before the cut may still land, and counters travel in heartbeats
            # (0.2 s): the baseline is taken a second into the cut.
            time.sleep(1.0)
            before = cluster.instances()["d0"]["transfers"]
            time.sleep(19)
            assert cluster.instances()["d0"]["transfers"] == before  # nothing lands through a cut link
        restored = time.monotonic()
        results = pending.result(150)
    assert_exact(references, prompts, results, 16)
    # Stuck: a stream that got no token in the partition's second half and was not finished at the
    # end of it; its next token is what the restored link carried.
    stuck = [r for r in results if not any(down + 10 < t <= restored for t, _ in r["times"])
             and r["times"][-1][0] > restored]
    assert stuck, "no stream waited on the cut link: the fault missed the transfers"
    resumed_after = max(next(t for t, _ in r["times"] if t > restored) - restored for r in stuck)
    print(f"\npartition: {len(stuck)} stuck streams continued within {resumed_after:.2f} s of the link's return")
    d0 = cluster.status()
    counters = next(i for i in d0["instances"] if i["name"] == "d0")
    assert counters["transfers"] > before
    assert resumed_after < 4.0, resumed_after  # the requirement is 2 s; the bound allows a loaded host
    cluster.wait_blocks_free()


def test_an_engine_with_the_wrong_key_never_gets_work_and_exits_saying_so(cluster, tmp_path):
    """An engine whose cluster key the front end refuses is never listed and never gets work; it
    logs that the handshake was refused (naming the cluster key) and exits with status 3 once
    --register-timeout-s has passed (engine/link.py)."""
    wrong = tmp_path / "wrong.key"
    subprocess.run([sys.executable, "-m", "server.cli", "keygen", str(wrong)], cwd=REPO, check=True, timeout=60,
                   capture_output=True)
    rogue = cluster.start_engine("decode", "rogue-d", "--max-model-len", "512", "--register-timeout-s", "10",
                                 key_file=wrong)
    try:
        prompts = random_prompts(4, 10, 40, VOCAB, 4403)
        assert all(r["error"] is None for r in cluster.stream(prompts, 4))
        deadline = time.monotonic() + 60  # loading the model, then the 10 s without a handshake
        while time.monotonic() < deadline and rogue.poll() is None:
            assert "rogue-d" not in cluster.instances()
            time.sleep(0.5)
        assert rogue.poll() == 3, "the engine with the wrong key did not exit with status 3 within 60 s"
        log = cluster.log_tail("rogue-d", 200).lower()
        assert "cluster key" in log and "could not register" in log, log[-2000:]
        assert "rogue-d" not in cluster.instances()
    finally:
        cluster.net.kill(rogue)


def test_a_slow_link_is_no_timeout_while_bytes_flow(checkpoints, references, tmp_path):
    """8 long prompts over a 2 Mbit/s KV link: their transfers take several times the 4 s
    no-progress bound (--kv-deadline-s), and not one of them fails."""
    c = Cluster(tmp_path, str(checkpoints["qwen2"]))
    try:
        c.start_front_end()
        c.start_engine("prefill", "p0", "--max-model-len", "1024")
        c.start_engine("decode", "d0", "--max-model-len", "1024", "--kv-deadline-s", "4")
        c.net.shape("p0", "kv", "2mbit")
        c.wait_ready(["p0", "d0"])
        prompts = random_prompts(8, 850, 950, VOCAB, 4404)
        start = time.monotonic()
        results = c.stream(prompts, 4)
        took = time.monotonic() - start
        print(f"\n8 long prompts over a 2 Mbit/s KV link: {took:.1f} s against a 4 s no-progress bound")
        assert_exact(references, prompts, results, 4)
        # d0's counters reach the front end with its heartbeats: wait (bounded) for the last one.
        deadline = time.monotonic() + 30
        while c.instances().get("d0", {}).get("transfers") != 8 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.instances()["d0"]["transfers"] == 8
        assert took > 3 * 4  # the transfers outlasted the bound several times
        c.wait_blocks_free()
    finally:
        c.close()
