"""The HTTP API in front of a prefill/decode pair: many streams, cut streams, TTFT from prefill
(issues: PD, OpenAI API)."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
from conftest import make_checkpoint
from pd_harness import ThreadedEngines, client_for
from test_detokenizer import make_tokenizer
from test_server_api import ServerThread, read_until_streaming

from engine.config import EngineConfig
from server.app import build_app

MODEL = "tiny-pd"


@pytest.fixture(scope="module")
def pd_server(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("pd-server-model")
    tok = make_tokenizer(path)
    make_checkpoint("qwen2", path, vocab_size=len(tok), seed=2)
    engines = ThreadedEngines(tmp_path_factory.mktemp("pd-ipc"))
    common = dict(model=str(path), max_model_len=256, num_threads=1)
    engines.add("prefill", "prefill-0", EngineConfig(**common, max_num_seqs=16))
    decode = engines.add("decode", "decode-0", EngineConfig(**common, max_num_seqs=64))
    engines.start()
    client = client_for(engines.server_addr, str(path), "pd", 256)
    app = build_app(client, AutoTokenizer.from_pretrained(str(path)), MODEL)
    with ServerThread(app) as server:
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "PD server never became healthy"
            time.sleep(0.1)
        yield server, client, decode
    engines.stop()
    assert app.state.internal_errors == 0


def wait_all_free(client, timeout: float = 30.0) -> None:
    """Bounded wait until every instance holds no request and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        infos = client.instances()
        if all(i.kv_blocks_free == i.kv_blocks_total for i in infos) and all(i.num_running == 0 for i in infos):
            return
        assert time.monotonic() < deadline, f"blocks not freed within {timeout}s: {infos}"
        time.sleep(0.05)


def test_64_concurrent_streams_match_non_streamed_text(pd_server):
    server, client, _ = pd_server
    prompts = [f"stream number {i} says" for i in range(64)]
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    expected = [oai.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text for p in prompts]

    async def one(aoai, p):
        text = ""
        stream = await aoai.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
        return text

    async def main():
        aoai = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(aoai, p) for p in prompts)), 120)
        finally:
            await aoai.close()

    assert asyncio.run(main()) == expected
    wait_all_free(client)


def test_32_cut_streams_free_every_block_on_every_instance(pd_server):
    server, client, _ = pd_server
    body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 200, "ignore_eos": True, "stream": True}
    clients = [httpx.Client(base_url=server.url, timeout=30) for _ in range(32)]
    try:
        responses = [c.send(c.build_request("POST", "/v1/completions", json=body), stream=True) for c in clients]
        readers = read_until_streaming(responses, chunks=2)  # noqa: F841 - alive until the cut
        assert sum(i.num_running + i.num_waiting for i in client.instances()) > 0
        for r in responses:
            r.close()
    finally:
        for c in clients:
            c.close()
    wait_all_free(client)


def test_first_token_comes_from_prefill_without_waiting_for_decode(pd_server, monkeypatch):
    """Decode's loop is held before its first step with the request until the first streamed token
    has arrived: that token is P's t0 (not one decode step had run), and the others come from
    decode's steps once it is let go."""
    server, client, decode = pd_server
    core = decode.core
    released = threading.Event()
    stepped = {"n": 0}  # decode steps run with work, after the release
    step = core.step

    def held_step():
        if core.has_unfinished():
            released.wait(60)
            stepped["n"] += 1
        return step()

    monkeypatch.setattr(core, "step", held_step)
    try:
        arrivals = []  # decode steps run when each token arrived
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 3, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"text":""' not in line.replace(" ", "") and '"text"' in line:
                    arrivals.append(stepped["n"])
                    released.set()
        assert len(arrivals) >= 2
        assert arrivals[0] == 0, "the first token waited for decode"
        assert all(n >= 1 for n in arrivals[1:]), f"later tokens should come from decode's steps: {arrivals}"
    finally:
        released.set()
    wait_all_free(client)
