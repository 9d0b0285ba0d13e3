"""The OpenAI-compatible server, end to end: the official `openai` client and raw httpx against a
real uvicorn server (background thread, 127.0.0.1, free port) in front of a LocalEngineClient
running a random-weight Qwen2 checkpoint with a byte-level BPE tokenizer trained in a fixture.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import httpx
import openai
import pytest
from conftest import make_checkpoint
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from local_client import LocalEngineClient
from pd_harness import wait_until
from test_detokenizer import make_tokenizer

from engine.config import EngineConfig
from engine.types import SamplingParams
from server.app import build_app
from server.detokenizer import IncrementalDetokenizer
from server.protocol import EngineUnavailableError, GenerationChunk, InstanceInfo

MODEL = "tiny"
MAX_MODEL_LEN = 192
KEY = "sekret-key"


# -- fixtures ------------------------------------------------------------------------------

class ServerThread:
    """uvicorn on an already-bound socket (no port race), in a daemon thread."""

    def __init__(self, app) -> None:
        import uvicorn

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("server-model")
    tok = make_tokenizer(path)
    make_checkpoint("qwen2", path, vocab_size=len(tok), seed=1)
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def engine(model_dir):
    client = LocalEngineClient(EngineConfig(model=str(model_dir), max_model_len=MAX_MODEL_LEN, num_kv_blocks=256,
                                            max_num_seqs=32, max_num_batched_tokens=1024, block_size=16))
    yield client
    asyncio.run(client.stop())


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    with ServerThread(build_app(engine, tokenizer, MODEL, manage_client=False)) as s:
        yield s
    assert s.app.state.internal_errors == 0


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def wait_idle(engine, timeout: float = 30.0) -> InstanceInfo:
    """Bounded wait until the engine holds no request and every KV block is free (the bound only
    keeps a broken release from hanging the test; how fast it happens is not under test)."""
    deadline = time.monotonic() + timeout
    while True:
        info = engine.instances()[0]
        if info.kv_blocks_free == info.kv_blocks_total and info.num_running == 0 and info.num_waiting == 0:
            return info
        assert time.monotonic() < deadline, f"engine not idle after {timeout}s: {info}"
        time.sleep(0.02)


def stream_completion_text(stream) -> tuple[dict[int, str], dict[int, str | None], object]:
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


def stream_chat_text(stream) -> tuple[dict[int, str], dict[int, str | None], object, list]:
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage, chunks = None, []
    for chunk in stream:
        chunks.append(chunk)
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, usage, chunks


# -- completions and chat ------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=1234)])
def test_completion_stream_matches_non_stream(oai, http, engine, sampling):
    prompt = "the quick brown fox"
    full = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=40, **sampling,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    n_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    assert full.usage.prompt_tokens == n_prompt
    assert full.usage.completion_tokens == 40 == len(choice.token_ids)
    assert full.usage.total_tokens == n_prompt + 40
    assert choice.prompt_token_ids == http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    # The server's text is exactly the tokenizer's decode of the generated ids.
    assert choice.text == http.post("/detokenize",
                                    json={"tokens": [t for t in choice.token_ids if t > 2]}).json()["prompt"]

    texts, finish, usage = stream_completion_text(oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, stream=True, stream_options={"include_usage": True}, **sampling,
        extra_body={"ignore_eos": True}))
    assert texts[0] == choice.text and finish[0] == "length"
    assert (usage.prompt_tokens, usage.completion_tokens) == (n_prompt, 40)
    wait_idle(engine)


def test_chat_stream_matches_non_stream(oai, http):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo, 你好 😀"}]
    full = oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=30, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert full.object == "chat.completion"
    msg = full.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    templated = http.post("/tokenize", json={"messages": messages}).json()
    assert full.usage.prompt_tokens == templated["count"]
    assert full.usage.completion_tokens == 30

    texts, finish, usage, chunks = stream_chat_text(oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and usage.completion_tokens == 30
    assert texts[0] == msg.content and finish[0] == "length"


def test_chat_template_is_applied(http, tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids) == expected
    r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}],
        "return_token_ids": True})
    assert r.status_code == 200 and r.json()["prompt_token_ids"] == http.post(
        "/tokenize", json={"messages": [{"role": "user", "content": "h\ni"}]}).json()["tokens"]


def test_default_max_tokens_is_remaining_context(oai, http):
    prompt = "stop here"
    n_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    r = oai.completions.create(model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == MAX_MODEL_LEN - n_prompt


def test_prompt_forms_and_echo(oai, http):
    ids = http.post("/tokenize", json={"prompt": "over the lazy dog"}).json()["tokens"]
    by_text = oai.completions.create(model=MODEL, prompt="over the lazy dog", max_tokens=8, temperature=0)
    by_ids = oai.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = oai.completions.create(model=MODEL, prompt=[ids, [5, 6, 7]], max_tokens=8, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text or by_text.choices[0].finish_reason == "stop"
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (len(ids) + 3, 16)
    strings = oai.completions.create(model=MODEL, prompt=["over the lazy dog", "stop"], max_tokens=4, temperature=0)
    assert len(strings.choices) == 2 and strings.usage.prompt_tokens == len(ids) + http.post(
        "/tokenize", json={"prompt": "stop"}).json()["count"]
    echo = oai.completions.create(model=MODEL, prompt="over the lazy dog", max_tokens=8, temperature=0, echo=True)
    assert echo.choices[0].text == "over the lazy dog" + by_text.choices[0].text
    texts, _, _ = stream_completion_text(oai.completions.create(model=MODEL, prompt="over the lazy dog", max_tokens=8,
                                                                temperature=0, echo=True, stream=True))
    assert texts[0] == echo.choices[0].text


def _boundary_stop(tokenizer, token_ids: list[int], text: str) -> str:
    """A 4-character stop string that straddles a token boundary in the middle of `text`."""
    detok = IncrementalDetokenizer(tokenizer)
    bounds, pos = [], 0
    for t in token_ids:
        pos += len(detok.push([t]))
        bounds.append(pos)
    for b in bounds[len(bounds) // 3:]:
        s = text[b - 2 : b + 2]
        if len(s) == 4 and "\ufffd" not in s and text.find(s) > 0:
            return s
    pytest.skip("no clean token boundary in the generated text")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_across_token_boundaries(oai, engine, tokenizer, stream):
    args = dict(model=MODEL, prompt="the lazy dog", max_tokens=48, temperature=1.0, seed=7)
    base = oai.completions.create(**args, extra_body={"ignore_eos": True, "return_token_ids": True})
    full, ids = base.choices[0].text, base.choices[0].token_ids
    stop = _boundary_stop(tokenizer, ids, full)
    expected = full[: full.find(stop)]
    extra = {"ignore_eos": True, "return_token_ids": True}
    if not stream:
        r = oai.completions.create(**args, stop=[stop, "\x00never"], extra_body=extra)
        c = r.choices[0]
        assert (c.text, c.finish_reason, c.stop_reason) == (expected, "stop", stop)
        # Tokens up to the one that completed the stop string, and no further.
        assert c.token_ids == ids[: len(c.token_ids)] and len(c.token_ids) < len(ids)
        assert r.usage.completion_tokens == len(c.token_ids)
        assert stop[0] not in c.text[len(expected):]
    else:
        pieces = []
        for chunk in oai.completions.create(**args, stop=stop, stream=True, extra_body={"ignore_eos": True}):
            for c in chunk.choices:
                pieces.append(c.text)
                if c.finish_reason:
                    assert c.finish_reason == "stop"
        text = "".join(pieces)
        assert text == expected and stop not in text
    wait_idle(engine)  # the engine request was aborted when the stop string matched

    chat_args = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=40, temperature=1.0, seed=3)
    chat = oai.chat.completions.create(**chat_args, extra_body={"ignore_eos": True, "return_token_ids": True})
    text = chat.choices[0].message.content
    stop = _boundary_stop(tokenizer, chat.choices[0].token_ids, text)
    if stream:
        texts, finish, _, _ = stream_chat_text(oai.chat.completions.create(**chat_args, stop=stop, stream=True,
                                                                         extra_body={"ignore_eos": True}))
        assert (texts[0], finish[0]) == (text[: text.find(stop)], "stop")
    else:
        again = oai.chat.completions.create(**chat_args, stop=stop, extra_body={"ignore_eos": True})
        assert (again.choices[0].message.content, again.choices[0].finish_reason) == (text[: text.find(stop)], "stop")
    wait_idle(engine)


def test_n_choices_and_seeds(oai):
    args = dict(model=MODEL, prompt="fox", max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    r = oai.completions.create(n=3, seed=100, **args)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 36
    assert len({c.text for c in r.choices}) > 1  # different seeds per choice
    again = oai.completions.create(n=3, seed=100, **args)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # reproducible
    # Choice i uses seed + i.
    assert oai.completions.create(seed=102, **args).choices[0].text == r.choices[2].text
    texts, finish, usage = stream_completion_text(oai.completions.create(
        n=3, seed=100, stream=True, stream_options={"include_usage": True}, **args))
    assert [texts[i] for i in range(3)] == [c.text for c in r.choices]
    assert usage.completion_tokens == 36 and set(finish.values()) == {"length"}

    chat_args = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10, temperature=1.0,
                     seed=5, n=2, extra_body={"ignore_eos": True})
    chat = oai.chat.completions.create(**chat_args)
    texts, _, _, _ = stream_chat_text(oai.chat.completions.create(stream=True, **chat_args))
    assert [texts[0], texts[1]] == [c.message.content for c in chat.choices]


def test_unseeded_sampling_varies(oai):
    outs = {oai.completions.create(model=MODEL, prompt="fox", max_tokens=12, temperature=1.0,
                                   extra_body={"ignore_eos": True}).choices[0].text for _ in range(3)}
    assert len(outs) > 1


def test_logprobs_completions_shape(oai):
    r = oai.completions.create(model=MODEL, prompt="the fox", max_tokens=6, temperature=0, logprobs=3,
                               extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 1 <= len(top) <= 4 and tok in top  # texts of different tokens may collide
        assert val == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the sampled token is the best
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = []
    for chunk in oai.completions.create(model=MODEL, prompt="the fox", max_tokens=6, temperature=0, logprobs=3,
                                        stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            if c.logprobs:
                streamed.extend(c.logprobs.token_logprobs)
    assert streamed == pytest.approx(lp.token_logprobs)


def test_logprobs_chat_shape(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                    temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.bytes, list) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
    text = r.choices[0].message.content
    specials = {"<|endoftext|>", "<|im_end|>", "<|im_start|>"}
    assert b"".join(bytes(e.bytes) for e in content if e.token not in specials).decode("utf-8", "replace") == text
    plain = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                        logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


def test_models_tokenize_detokenize(oai, http):
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL
    tok = http.post("/tokenize", json={"prompt": "héllo 😀"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "héllo 😀"
    assert http.post("/detokenize", json={"tokens": [10**6]}).status_code == 400


# -- errors --------------------------------------------------------------------------------

def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_openai_client_errors(oai, engine, tokenizer):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=MAX_MODEL_LEN)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt=[5] * MAX_MODEL_LEN, max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=3)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=4, stream=True, top_p=0)
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="no-such-model", prompt="x", max_tokens=4)
    assert e.value.body["code"] == "model_not_found"


def test_api_key(engine, tokenizer):
    with ServerThread(build_app(engine, tokenizer, MODEL, api_key=KEY, manage_client=False)) as s:
        for key in ("wrong", ""):
            bad = openai.OpenAI(base_url=s.url + "/v1", api_key=key or "x", max_retries=0, timeout=30)
            if not key:
                bad = bad.with_options(default_headers={"Authorization": ""})
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1
        with httpx.Client(base_url=s.url, timeout=30) as http:
            _error(http.post("/v1/chat/completions", json={"messages": []}), 401)
            assert http.get("/health").status_code == 200  # not under /v1
            assert http.get("/metrics").status_code == 200
        assert s.app.state.internal_errors == 0


def test_bad_input_over_raw_http(http, server, engine):
    post = lambda body, path="/v1/completions", **kw: http.post(path, content=body, **kw)  # noqa: E731
    assert "JSON" in _error(post(b'{"prompt": "x", '), 400)["message"]
    _error(post(b'[1, 2]'), 400)
    _error(post(b''), 400)
    _error(post(b'{"prompt": "\xff\xfe"}'), 400)                     # invalid UTF-8
    _error(post(b'{"prompt": "\\ud800 lone surrogate"}'), 400)
    _error(post(json.dumps({"prompt": 5})), 400)                       # wrong types
    assert _error(post(json.dumps({"prompt": "x", "max_tokens": "many"})), 400)["param"] == "max_tokens"
    _error(post(json.dumps({"prompt": "x", "temperature": [1]})), 400)
    _error(post(json.dumps({"prompt": [1.5, 2]})), 400)
    _error(post(json.dumps({"prompt": [True]})), 400)
    _error(post(json.dumps({"prompt": "x", "max_tokens": -3})), 400)   # negative values
    _error(post(json.dumps({"prompt": "x", "n": -1})), 400)
    _error(post(json.dumps({"prompt": "x", "n": 10**6})), 400)
    _error(post(json.dumps({"prompt": "x", "logprobs": -1})), 400)
    _error(post(json.dumps({"prompt": "x", "seed": 2**80})), 400)
    _error(post('{"prompt": "x", "temperature": NaN}'), 400)
    _error(post('{"prompt": "x", "top_p": 1e999}'), 400)
    err = _error(post(json.dumps({"prompt": "x", "max_tokens": 10**12})), 400)   # huge max_tokens
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    _error(post(json.dumps({"prompt": [1, 2, engine.vocab_size]})), 400)     # ids outside the vocab
    _error(post(json.dumps({"prompt": [1, -2]})), 400)
    _error(post(json.dumps({"prompt": [[1, 2], [2**70]]})), 400)
    _error(post(json.dumps({"prompt": "x", "stop_token_ids": [10**9]})), 400)
    _error(post(json.dumps({"prompt": []})), 400)
    _error(post(json.dumps({"prompt": ""})), 400)
    _error(post(json.dumps({"prompt": "x", "stop": [""]})), 400)
    _error(post(json.dumps({"prompt": "x", "stop": ["a"] * 100})), 400)
    _error(post(json.dumps({"prompt": "x", "suffix": "y"})), 400)
    _error(post(json.dumps({"prompt": "x", "logit_bias": {"5": 1}})), 400)
    _error(post(json.dumps({"prompt": "x", "echo": True, "logprobs": 21})), 400)  # prompt logprobs: at most 20
    _error(post(json.dumps({"prompt": "x", "min_tokens": 5, "max_tokens": 2})), 400)
    _error(post(json.dumps({"messages": []}), "/v1/chat/completions"), 400)
    _error(post(json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                "/v1/chat/completions"), 400)
    _error(post(json.dumps({"messages": [{"content": "no role"}]}), "/v1/chat/completions"), 400)
    _error(post(json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
                "/v1/chat/completions"), 400)
    _error(post(json.dumps({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50, "logprobs": True}),
                "/v1/chat/completions"), 400)
    _error(post(b"{", "/tokenize"), 400)
    _error(post(json.dumps({"tokens": ["a"]}), "/detokenize"), 400)
    # 10 MB body: refused before parsing.
    assert _error(post(b'{"prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}'), 413)["code"] == "request_too_large"
    _error(post(iter([b'{"prompt": "'] + [b"a" * 1024 * 1024] * 6 + [b'"}'])), 413)  # chunked, no Content-Length
    # Unknown fields are ignored.
    ok = post(json.dumps({"prompt": "x", "max_tokens": 2, "frobnicate": {"deep": [1]}, "metadata": {"a": "b"}}))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    _error(http.get("/v1/nothing-here"), 404)
    _error(http.get("/v1/completions"), 405)
    # Still serving, and nothing reached the 500 handler.
    assert post(json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 3})).status_code == 200
    assert server.app.state.internal_errors == 0
    wait_idle(engine)


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 8),
                     st.sampled_from([0, -1, 2**31, 2**63, -(2**63), 10**30]),
                     st.floats(allow_nan=True, allow_infinity=True, width=32), st.text(max_size=12))
_junk = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3), max_leaves=8)
_flag = st.booleans()
_prob = st.floats(-0.5, 2.5)
_ids = st.lists(st.integers(-2, 1100), min_size=0, max_size=6)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "bogus"]),
                                  "content": st.text(max_size=12) | st.just([{"type": "text", "text": "hi"}])})
# Plausible values for each field (often valid, sometimes just out of range); any field may
# also get arbitrary JSON.
_plausible = {
    "model": st.sampled_from([MODEL, "other"]),
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.text(max_size=8), max_size=3), _ids,
                        st.lists(_ids, max_size=3)),
    "messages": st.lists(_message, max_size=3),
    "max_tokens": st.integers(-1, 5) | st.sampled_from([MAX_MODEL_LEN, 10**9]),
    "max_completion_tokens": st.integers(-1, 5),
    "temperature": _prob, "top_p": _prob, "min_p": _prob, "top_k": st.integers(-2, 50),
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3), "repetition_penalty": st.floats(-1, 3),
    "n": st.integers(0, 3), "best_of": st.integers(0, 3), "seed": st.integers(-(2**64), 2**64),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3), "stop_token_ids": _ids,
    "logprobs": st.integers(-1, 25) | _flag, "top_logprobs": st.integers(-1, 25), "min_tokens": st.integers(-1, 6),
    "echo": _flag, "stream": _flag, "ignore_eos": _flag, "return_token_ids": _flag, "skip_special_tokens": _flag,
    "include_stop_str_in_output": _flag, "stream_options": st.fixed_dictionaries({"include_usage": _flag}),
    "user": st.text(max_size=5), "logit_bias": st.just({}) | st.just({"5": 1.0}), "suffix": st.none() | st.just("x"),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]), "tokens": _ids,
    "add_generation_prompt": _flag, "continue_final_message": _flag, "unknown_field": _junk,
}
_bases = {
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 3},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [5, 6]},
}


@st.composite
def _requests(draw):
    path = draw(st.sampled_from(sorted(_bases)))
    if draw(st.integers(0, 9)) == 0:
        return path, draw(st.binary(max_size=40))
    body = dict(_bases[path])
    for key in draw(st.lists(st.sampled_from(sorted(_plausible)), max_size=5, unique=True)):
        body[key] = draw(_junk if draw(st.integers(0, 4)) == 0 else _plausible[key])
    for key in draw(st.lists(st.sampled_from(sorted(body)), max_size=1)):
        del body[key]
    return path, json.dumps(body).encode()


@settings(max_examples=60, deadline=timedelta(seconds=20),
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=_requests())
def test_fuzz_never_5xx(http, server, request):
    path, content = request
    r = http.post(path, content=content, timeout=30)
    event(f"{path} -> {r.status_code}")
    assert r.status_code < 500, (content, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text
    assert server.app.state.internal_errors == 0


# -- concurrency, disconnects, capacity ----------------------------------------------------

def test_concurrent_streams(oai, server, engine):
    prompts = [f"the fox {i} jumps" for i in range(16)]
    expected = [oai.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=1.0, seed=i,
                                       extra_body={"ignore_eos": True}).choices[0].text for i, p in enumerate(prompts)]

    async def one(client, i, p):
        texts = ""
        stream = await client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=1.0, seed=i,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            texts += "".join(c.text for c in chunk.choices)
        return texts

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
        try:
            return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))
        finally:
            await client.close()

    assert asyncio.run(main()) == expected
    wait_idle(engine)


def read_until_streaming(responses: list[httpx.Response], chunks: int) -> list:
    """Read `chunks` data chunks from every SSE response, so that all are mid-stream. Returns their
    line iterators: the caller keeps them alive until it cuts the streams."""
    readers = []
    for r in responses:
        assert r.status_code == 200
        readers.append(r.iter_lines())
        got = 0
        for line in readers[-1]:
            got += line.startswith("data: {")
            if got >= chunks:
                break
    return readers


def test_cut_streams_free_every_block(server, engine):
    body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 150, "ignore_eos": True, "stream": True}
    clients = [httpx.Client(base_url=server.url, timeout=30) for _ in range(8)]
    try:
        responses = []
        for i, c in enumerate(clients):
            req = c.build_request("POST", "/v1/completions" if i % 2 else "/v1/chat/completions",
                                  json=body if i % 2 else {**body, "messages": [{"role": "user", "content": "x"}]})
            responses.append(c.send(req, stream=True))
        readers = read_until_streaming(responses, chunks=3)  # noqa: F841 - alive until the cut
        assert engine.instances()[0].num_running > 0
        for r in responses:
            r.close()
    finally:
        for c in clients:
            c.close()
    wait_idle(engine)


class GatedClient:
    """An EngineClient whose requests emit one token, then wait for `gate` before finishing.
    Records which streams were closed before finishing (the server cut them)."""

    max_model_len = 64
    vocab_size = 100
    eos_token_ids = [1]

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.closed_early: list[str] = []

    async def start(self) -> None: ...
    async def stop(self) -> None: ...

    def generate(self, request_id, prompt_token_ids, params):
        async def gen():
            done = False
            try:
                yield GenerationChunk([10])
                while not self.gate.is_set():
                    await asyncio.sleep(0.01)
                done = True
                yield GenerationChunk([11], finish_reason="length")
            finally:
                if not done:
                    self.closed_early.append(request_id)
        return gen()

    async def abort(self, request_id: str) -> None: ...
    def is_ready(self) -> bool: return True
    def instances(self): return []


def test_capacity_limit_gives_429_and_cut_streams_release():
    gated = GatedClient()
    with ServerThread(build_app(gated, None, MODEL, max_queue=1)) as s, httpx.Client(base_url=s.url,
                                                                                     timeout=30) as http:
        body = {"prompt": [5], "max_tokens": 2, "stream": True, "return_token_ids": True}
        with http.stream("POST", "/v1/completions", json=body) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # keep a reference: a collected iterator closes the stream
            assert next(lines).startswith("data: {")
            busy = http.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
            err = _error(busy, 429)
            assert busy.headers["retry-after"] == "1" and err["type"] == "server_overloaded"
            oai = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=30)
            with pytest.raises(openai.RateLimitError):
                oai.completions.create(model=MODEL, prompt=[5], max_tokens=2)
        # Cutting the stream closed the client's generator (the engine request is aborted) and
        # released the slot.
        wait_until(lambda: gated.closed_early and not s.app.state.serving.in_flight, 30,
                   "the cut stream to close its generator and release its slot")
        assert len(gated.closed_early) == 1
        # A non-streaming client that gives up is noticed too (polled while waiting).
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={"prompt": [5]}, timeout=0.3)
        wait_until(lambda: len(gated.closed_early) >= 2 and not s.app.state.serving.in_flight, 30,
                   "the abandoned request to close its generator and release its slot")
        gated.gate.set()
        r = http.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert len(gated.closed_early) == 2 and s.app.state.serving.in_flight == 0
        assert 'pdserve:request_success_total{finished_reason="abort"} 2.0' in http.get("/metrics").text
        assert s.app.state.internal_errors == 0


# -- metrics and health --------------------------------------------------------------------

def test_metrics_exported(oai, http):
    oai.completions.create(model=MODEL, prompt="fox", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    text = http.get("/metrics").text
    for name in ("pdserve:time_to_first_token_seconds_count", "pdserve:inter_token_latency_seconds_count",
                 "pdserve:e2e_request_latency_seconds_count", "pdserve:request_queue_time_seconds_count",
                 "pdserve:prompt_tokens_total", "pdserve:generation_tokens_total"):
        value = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))
        assert value > 0, name
    assert 'pdserve:request_success_total{finished_reason="length"}' in text
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_blocks_free", "kv_blocks_total",
                  "kv_cache_usage_perc"):
        assert f'pdserve:{gauge}{{instance="colocated-0",role="colocated"}}' in text
    assert 'pdserve:num_preemptions_total{instance="colocated-0"' in text


class StubClient:
    """A minimal EngineClient for what a real engine cannot easily show (not ready, counters)."""

    max_model_len = 64
    vocab_size = 100
    eos_token_ids = [1]

    def __init__(self) -> None:
        self.ready = False
        self.aborted: list[str] = []

    async def start(self) -> None: ...
    async def stop(self) -> None: ...

    def generate(self, request_id, prompt_token_ids, params):
        if params.temperature == 3.0:
            raise RuntimeError("a bug in the client")
        if params.top_p == 0.5:
            raise EngineUnavailableError("no decode instance is ready")

        async def gen():
            if params.temperature == 2.0:
                raise ValueError("temperature: refused lazily by this client")
            if params.temperature == 0.5:
                raise EngineUnavailableError("no prefill instance is ready")
            if params.temperature == 1.5:
                yield GenerationChunk([], finish_reason="error", error="KV transfer failed")
                return
            for i in range(3):
                yield GenerationChunk([10 + i], finish_reason="length" if i == 2 else None)
        return gen()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def is_ready(self) -> bool:
        return self.ready

    def instances(self):
        return [InstanceInfo("prefill-0", "prefill", True, 10, 20, 1, 2, {"kv_transfer_bytes": 123.0}),
                InstanceInfo("decode-0", "decode", True, 5, 20, 3, 0, {"spec_decode_num_drafts": 7.0,
                                                                      "spec_decode_num_accepted_tokens_total": 4.0})]


def test_health_and_instance_counters_with_a_stub_client():
    from fastapi.testclient import TestClient

    stub = StubClient()
    app = build_app(stub, None, "stub")
    with TestClient(app) as tc:
        _error(tc.get("/health"), 503)
        stub.ready = True
        assert tc.get("/health").status_code == 200
        text = tc.get("/metrics").text
        assert 'pdserve:kv_transfer_bytes_total{instance="prefill-0",role="prefill"} 123.0' in text
        assert 'pdserve:spec_decode_num_drafts_total{instance="decode-0",role="decode"} 7.0' in text
        assert 'pdserve:spec_decode_num_accepted_tokens_total{instance="decode-0",role="decode"} 4.0' in text
        assert 'pdserve:kv_cache_usage_perc{instance="decode-0",role="decode"} 0.75' in text
        # No tokenizer: token ids work, text prompts and chat are a clean 400.
        r = tc.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3, "return_token_ids": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [10, 11, 12]
        _error(tc.post("/v1/completions", json={"prompt": "text"}), 400)
        _error(tc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 400)
        # A client that validates or dispatches lazily (on first iteration) still yields a real
        # 400 / 503, streaming or not; so does one that raises at call time.
        for stream in (False, True):
            body = {"prompt": [5], "max_tokens": 3, "stream": stream}
            assert _error(tc.post("/v1/completions", json={**body, "temperature": 2.0}), 400)["param"] == "temperature"
            for field in ({"temperature": 0.5}, {"top_p": 0.5}):
                r = tc.post("/v1/completions", json={**body, **field})
                assert _error(r, 503)["code"] == "engine_unavailable" and r.headers["retry-after"] == "1"
        # An engine failure is a 500 (never a 200 with garbage), in the stream an error event.
        assert _error(tc.post("/v1/completions", json={"prompt": [5], "temperature": 1.5}),
                      500)["code"] == "engine_error"
        lines = tc.post("/v1/completions", json={"prompt": [5], "temperature": 1.5, "stream": True}).text.splitlines()
        assert any("KV transfer failed" in line for line in lines) and lines[-2] == "data: [DONE]"
    assert app.state.internal_errors == 0
    # A bug (not bad input) reaches the catch-all handler: a clean OpenAI-shaped 500.
    with TestClient(app, raise_server_exceptions=False) as tc:
        err = _error(tc.post("/v1/completions", json={"prompt": [5], "temperature": 3.0}), 500)
        assert err["type"] == "server_error" and "bug" not in err["message"]
    assert app.state.internal_errors == 1


def test_dead_engine_reports_not_ready(model_dir):
    client = LocalEngineClient(EngineConfig(model=str(model_dir), max_model_len=64, num_kv_blocks=16))

    def broken_step():
        raise RuntimeError("simulated engine crash")

    client.core.step = broken_step

    async def run():
        await client.start()
        assert client.is_ready()
        chunks = [c async for c in client.generate("d1", [5, 6], SamplingParams(max_tokens=4))]
        assert chunks[-1].finish_reason == "error" and "simulated engine crash" in chunks[-1].error
        assert not client.is_ready() and not client.instances()[0].ready
        after = [c async for c in client.generate("d2", [5, 6], SamplingParams(max_tokens=4))]
        assert after[-1].finish_reason == "error"
        await client.stop()

    asyncio.run(run())


def test_local_client_validates_before_yielding(engine):
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="prompt"):
        engine.generate("v1", [], params)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate("v2", [engine.vocab_size], params)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate("v3", [5] * MAX_MODEL_LEN, params)

    async def run():
        chunks = [c async for c in engine.generate("v4", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))]
        assert sum(len(c.token_ids) for c in chunks) == 3 and chunks[-1].finish_reason == "length"
        # Stopping early aborts the request.
        gen = engine.generate("v5", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
        first = await gen.__anext__()
        assert first.token_ids
        await gen.aclose()
        # An explicit abort ends the stream with finish_reason "abort".
        gen = engine.generate("v6", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
        await gen.__anext__()
        await engine.abort("v6")
        rest = [c async for c in gen]
        assert rest[-1].finish_reason == "abort"

    asyncio.run(run())
    wait_idle(engine)
