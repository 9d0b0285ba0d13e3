"""Failover: a request whose engine dies mid-stream is resumed on live instances, and the client's
stream goes on with no token repeated or missing (issue 15, part 1; docs/architecture.md, KV transfer).

The resume sends prompt + every streamed token to a live P, which computes the KV of all but the
last streamed token and hands that one to a live D as its t0 (nothing is sampled on P); D continues
at the next output index, so greedy and seeded runs equal an undisturbed run.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from pathlib import Path

import httpx
import pytest
from conftest import BUNDLED_MODEL, random_prompts
from pd_harness import (
    ProcessGroup,
    ThreadedEngines,
    client_for,
    running_client,
    wait_blocks_free,
    wait_ready,
    wait_until,
)
from test_server_api import ServerThread

from engine.config import EngineConfig, KVTransferConfig
from engine.process import FaultExitOnPrompt
from engine.types import SamplingParams
from server.app import build_app

VOCAB = 384
POISON = [7, 7, 7, 7]  # prompts below draw ids >= 10, so only the poison request holds this sequence


# -- forced resumes, both engines alive (in-process, fast) ---------------------------------------

async def generate_with_resumes(client, prompt: list[int], params: SamplingParams, resume_at: list[int]) -> dict:
    """Stream one request; each time the tokens streamed so far pass a point of `resume_at`, fail its
    attempt over as if its engine had died (the front end's own path: abort, re-dispatch with the
    streamed tokens)."""
    req_id, tokens, pending = uuid.uuid4().hex, [], sorted(resume_at)
    result = {"tokens": tokens, "finish_reason": None, "error": None}
    async for chunk in client.generate(req_id, prompt, params):
        tokens.extend(chunk.token_ids)
        if chunk.finish_reason:
            result["finish_reason"], result["error"] = chunk.finish_reason, chunk.error
        elif pending and len(tokens) >= pending[0]:
            pending.pop(0)
            client._recover(client.tracked[req_id], "test: forced failover", ())
    return result


def test_forced_resumes_are_exact_greedy_and_seeded(mtp_checkpoints, references, tmp_path):
    """Resumes at t0, mid-block and on a block boundary (prefix cache hits up to the cap), with MTP on
    D and chunked prefill on P: greedy equals transformers, seeded sampling with penalties and
    min_tokens equals the undisturbed run, and every block comes back."""
    model = str(mtp_checkpoints["qwen2"])
    engines = ThreadedEngines(tmp_path)
    common = dict(model=model, max_model_len=256, num_threads=1, block_size=16)
    # Layer-wise KV for these short prompts too: a resumed request's layer stream must cover prompt + streamed[:-1].
    engines.add("prefill", "prefill-0", EngineConfig(**common, speculative_method="mtp", num_speculative_tokens=1,
                                                     max_num_batched_tokens=32),
                KVTransferConfig(mode="layerwise", layerwise_min_tokens=0))
    engines.add("decode", "decode-0", EngineConfig(**common, speculative_method="mtp", num_speculative_tokens=2))
    engines.start()
    client = client_for(engines.server_addr, model, "pd", 256)
    prompts = random_prompts(4, 15, 70, VOCAB, 151)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.9, seed=100 + i, max_tokens=40, min_tokens=30, repetition_penalty=1.3,
                             presence_penalty=0.4, top_k=50) for i in range(len(prompts))]
    # Prompt 2 resumes where prompt + streamed[:-1] fills whole blocks: on the second greedy run P's
    # prefix cache holds all of them, and must still leave a token to compute.
    points = [[1], [5, 17], [16 - len(prompts[2]) % 16 + 1], [2, 3, 33]]
    try:
        with running_client(client) as run:
            run(wait_ready(client))
            for i, prompt in enumerate(prompts):
                for params, check in ((greedy, "greedy"), (seeded[i], "seeded")):
                    plain = run(generate_with_resumes(client, prompt, params, []))
                    for _ in range(2 if check == "greedy" else 1):
                        resumed = run(generate_with_resumes(client, prompt, params, points[i]))
                        assert resumed["error"] is None and resumed["finish_reason"] == plain["finish_reason"], resumed
                        assert resumed["tokens"] == plain["tokens"], f"prompt {i} ({check}), resumes at {points[i]}"
                    if check == "greedy":
                        references["qwen2"].assert_matches(prompt, resumed["tokens"], 40, f"resumed/prompt {i}")
            assert client.num_resumed == sum(len(p) for p in points) * 3
            assert client.num_failed_after_resume == 0
            assert client.counters()["requests_resumed_total"] == client.num_resumed
            run(wait_blocks_free(client))
    finally:
        engines.stop()


def test_resume_refused_past_max_resumes_and_off_switch(checkpoints, tmp_path):
    """max_resumes=0 turns failover off: the request ends with an error that names the limit."""
    model = str(checkpoints["qwen2"])
    engines = ThreadedEngines(tmp_path)
    common = dict(model=model, max_model_len=256, num_threads=1)
    engines.add("prefill", "prefill-0", EngineConfig(**common))
    engines.add("decode", "decode-0", EngineConfig(**common))
    engines.start()
    client = client_for(engines.server_addr, model, "pd", 256, max_resumes=0)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    try:
        with running_client(client) as run:
            run(wait_ready(client))
            result = run(generate_with_resumes(client, random_prompts(1, 20, 20, VOCAB, 152)[0], params, [3]))
            assert result["finish_reason"] == "error" and "--max-resumes" in result["error"], result
            assert client.num_resumed == 0
            run(wait_blocks_free(client))
    finally:
        engines.stop()


# -- kill -9 of real engine processes, behind the HTTP API ---------------------------------------

NUM_STREAMS, NEW_TOKENS = 16, 96
# 20 blocks of 16 tokens: a D reserves for ~6 prompts at a time, so of 16 streams some wait with P
# holding their KV after t0, and running ones preempt each other (recompute) as they grow.
DECODE_FLAGS = ("--max-model-len", "256", "--num-kv-blocks", "20", "--block-size", "16")
FAULT_ENV = {"PDSERVE_FAULT_EXIT_ON_PROMPT": ",".join(map(str, POISON))}


class Cluster:
    """`pdserve serve`'s layout -- `server.cli` engine processes of the bundled model (MTP on D,
    prefix caching on) -- 2 P + 2 D, each D with little KV memory so that requests queue there
    while their P holds the KV after t0; the front end and HTTP API in this process."""

    def __init__(self, tmp: Path) -> None:
        from transformers import AutoTokenizer

        self.group = ProcessGroup(tmp)
        model = str(BUNDLED_MODEL)
        for i in range(2):
            self.group.add("prefill", f"prefill-{i}", model, "--max-model-len", "256")
            self.group.add("decode", f"decode-{i}", model, *DECODE_FLAGS, env=FAULT_ENV)
        self.client = client_for(self.group.server_addr, model, "pd", 256, dead_after_s=1.0, resume_wait_s=40.0)
        self.app = build_app(self.client, AutoTokenizer.from_pretrained(model), "tiny")
        self.server = ServerThread(self.app).__enter__()
        self.restore()

    def ready(self) -> set[str]:
        return {i.name for i in self.client.instances() if i.ready}

    def restore(self) -> None:
        """Every engine process running and registered (a test may have killed some)."""
        for name, proc in self.group.procs.items():
            if proc.poll() is not None:
                self.group.start(name, FAULT_ENV if name.startswith("decode") else None)
        wait_until(lambda: self.ready() == set(self.group.procs), 90, "all four engines to register")

    def close(self) -> None:
        self.server.__exit__(None, None, None)
        self.group.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("failover"))
    rng = random.Random(153)
    c.prompts = [[rng.randrange(10, 4000) for _ in range(rng.randint(20, 40))] for _ in range(NUM_STREAMS)]
    c.undisturbed = asyncio.run(stream_all(c.server.url, c.prompts))
    for r in c.undisturbed:
        assert r["error"] is None and len(r["tokens"]) == NEW_TOKENS, r
    yield c
    c.close()
    assert c.app.state.internal_errors == 0


async def stream_one(http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int = NEW_TOKENS,
                     progress: list[int] | None = None, index: int = 0) -> dict:
    """One streamed completion over SSE: every chunk's token ids and text, the finish, any error event.
    `progress[index]` follows the number of tokens received."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    out = {"tokens": [], "text": "", "chunks": 0, "finish_reason": None, "error": None, "usage": None, "done": False}
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]["message"]
                continue
            if event.get("usage"):
                out["usage"] = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                out["tokens"] += choice.get("token_ids") or []
                if progress is not None:
                    progress[index] = len(out["tokens"])
                out["text"] += choice["text"]
                out["chunks"] += bool(choice.get("token_ids"))
                out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


async def stream_all(url: str, prompts: list[list[int]], during=None) -> list[dict]:
    """All prompts at once; `during(progress)` (a coroutine function) runs alongside, e.g. to kill an
    engine; progress[i] is the number of tokens stream i has received."""
    progress = [0] * len(prompts)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=45)) as http:
        tasks = [asyncio.ensure_future(stream_one(http, url, p, progress=progress, index=i))
                 for i, p in enumerate(prompts)]
        if during is not None:
            await asyncio.wait_for(during(progress), 60)
        return await asyncio.wait_for(asyncio.gather(*tasks), 90)


def assert_same_streams(results: list[dict], undisturbed: list[dict]) -> None:
    for i, (r, u) in enumerate(zip(results, undisturbed)):
        assert r["error"] is None and r["done"] and r["finish_reason"] == "length", f"stream {i}: {r}"
        # Each SSE chunk's token ids, concatenated: a repeated or missing chunk would show here.
        assert r["tokens"] == u["tokens"], f"stream {i} differs from the undisturbed run"
        assert r["text"] == u["text"] and r["usage"] == NEW_TOKENS, f"stream {i}"


def resumed_on_metrics(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics").text
    values = [next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))
              for name in ("pdserve:requests_resumed_total", "pdserve:requests_failed_after_resume_total")]
    return values[0], values[1]


async def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def test_decode_killed_mid_stream_every_stream_completes_exactly(cluster):
    cluster.restore()
    client, resumed_before = cluster.client, cluster.client.num_resumed
    victim = {}

    async def kill_half_way(progress: list[int]):
        await wait_for(lambda: sum(progress) >= NUM_STREAMS * NEW_TOKENS / 2, 30, "the streams to be half done")
        held = {d: sum(t.attempt.decode == d for t in client.tracked.values()) for d in ("decode-0", "decode-1")}
        victim["name"] = max(held, key=held.get)
        victim["held"] = held[victim["name"]]
        cluster.group.kill(victim["name"])

    results = asyncio.run(stream_all(cluster.server.url, cluster.prompts, kill_half_way))
    assert_same_streams(results, cluster.undisturbed)
    assert victim["held"] > 0 and client.num_resumed - resumed_before >= 1
    assert client.num_failed_after_resume == 0
    assert asyncio.run(_blocks_free(client))
    assert resumed_on_metrics(cluster.server.url)[0] == client.num_resumed


def test_prefill_killed_holding_requests_after_t0_every_stream_completes_exactly(cluster):
    """P streamed t0 and holds the KV while D has not pulled it yet: P dies, D's pull cannot
    happen, and the request is resumed (prompt prefilled again on the other P, t0 handed over).

    Made to happen at a known point: both D processes are stopped (SIGSTOP) before the streams
    start, so no KV can be pulled; once every stream has its t0, every prompt's KV is held on its
    P, and the P holding the most is killed before the D processes go on. While they are stopped
    the front end's dead-after bound is lifted (a stopped D sends no heartbeat), and it is put
    back once both have heart-beaten again: the dead P, silent since the kill, is then declared
    dead and its requests resumed."""
    cluster.restore()
    client, router = cluster.client, cluster.client.router
    decodes = ("decode-0", "decode-1")
    dead_after_s = router.dead_after_s
    killed = {}

    def holding() -> dict[str, int]:
        out = {"prefill-0": 0, "prefill-1": 0}
        for t in list(client.tracked.values()):
            if t.streamed and not t.attempt.decode_started and t.attempt.prefill in out:
                out[t.attempt.prefill] += 1
        return out

    async def kill_a_prefill_holding_kv(progress: list[int]):
        await wait_for(lambda: all(progress), 45, "every stream's t0 (from P, D being stopped)")
        counts = holding()
        killed["name"] = max(counts, key=counts.get)
        killed["held"], killed["all"] = counts[killed["name"]], sum(counts.values())
        cluster.group.kill(killed["name"])
        thawed = time.monotonic()
        for name in decodes:
            cluster.group.resume(name)
        await wait_for(lambda: all(client.table[name].last_seen > thawed for name in decodes), 30,
                       "both decode engines to heart-beat again")
        router.dead_after_s = dead_after_s

    resumed_before = client.num_resumed
    router.dead_after_s = 3600.0
    try:
        for name in decodes:
            cluster.group.pause(name)
        results = asyncio.run(stream_all(cluster.server.url, cluster.prompts, kill_a_prefill_holding_kv))
    finally:
        for name in decodes:
            cluster.group.resume(name)
        router.dead_after_s = dead_after_s
    assert killed["all"] == NUM_STREAMS and killed["held"] > 0, killed  # every prompt's KV held on a P
    assert_same_streams(results, cluster.undisturbed)
    assert client.num_failed_after_resume == 0
    assert asyncio.run(_blocks_free(client))
    assert client.num_resumed - resumed_before >= killed["held"], killed  # each stream it held was resumed


def test_with_every_decode_dead_requests_wait_for_one_to_come_back(cluster):
    """Both D die mid-stream: the requests wait (up to --resume-wait-s) for a D to register again,
    then resume there and complete exactly."""
    cluster.restore()
    client, resumed_before = cluster.client, cluster.client.num_resumed

    async def kill_both_then_restart_one(progress: list[int]):
        await wait_for(lambda: sum(progress) >= NUM_STREAMS * NEW_TOKENS / 4, 30, "the streams to be under way")
        for name in ("decode-0", "decode-1"):
            cluster.group.kill(name)
        await wait_for(lambda: len(client.redispatching) > 0, 10, "requests waiting for a decode instance")
        cluster.group.start("decode-1", FAULT_ENV)

    results = asyncio.run(stream_all(cluster.server.url, cluster.prompts, kill_both_then_restart_one))
    assert_same_streams(results, cluster.undisturbed)
    assert client.num_resumed - resumed_before >= 1 and not client.redispatching
    assert asyncio.run(_blocks_free(client))


def test_poison_request_stops_after_the_resume_limit(cluster):
    """A request that crashes every D it lands on (fault hook PDSERVE_FAULT_EXIT_ON_PROMPT) is resumed
    `max_resumes` times, then ends with a clear error instead of taking down D after D."""
    cluster.restore()
    client = cluster.client
    resumed_before, failed_before = client.num_resumed, client.num_failed_after_resume
    client.max_resumes = 1
    try:
        async def run():
            async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=30)) as http:
                return await stream_one(http, cluster.server.url, [11, 12, *POISON, 13, 14], max_tokens=40)

        result = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        client.max_resumes = 3
    assert result["error"] and "not resumed again after 1 resume(s)" in result["error"], result
    assert "decode instance" in result["error"] and "died" in result["error"]
    assert len(result["tokens"]) == 1  # t0 came from P; no D lived to send more
    codes = {name: cluster.group.procs[name].wait(10) for name in ("decode-0", "decode-1")}
    assert codes == {"decode-0": FaultExitOnPrompt.EXIT_CODE, "decode-1": FaultExitOnPrompt.EXIT_CODE}
    assert client.num_resumed - resumed_before == 1
    assert client.num_failed_after_resume - failed_before == 1
    assert resumed_on_metrics(cluster.server.url) == (client.num_resumed, client.num_failed_after_resume)


async def _blocks_free(client) -> bool:
    await wait_blocks_free(client, timeout=10)
    return True
