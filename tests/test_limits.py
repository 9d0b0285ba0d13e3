"""Limits that fair clients never hit (issue 45, build 4; server/limits.py, server/backpressure.py).

Over HTTP: a body that never arrives whole holds a connection, never a serving slot (the slow-body
probe: 520 slow clients, a normal one is still served); a lying Content-Length gets a prompt 413;
Content-Length with Transfer-Encoding gets 400; a body past its read timeout gets 408; per-client
and per-key caps answer 429 below the global cap; a response too large is refused up front; a
client that stops reading its stream has it aborted, and the engine frees the request.
"""
from __future__ import annotations

import json
import socket

import httpx
import pytest
from conftest import BUNDLED_MODEL
from http_harness import served
from pd_harness import wait_until
from test_server_api import GatedClient, ServerThread

from server.app import build_app
from server.limits import HTTPLimits, raise_open_files_limit

MODEL = "pdserve-tiny"
GREEDY = {"prompt": [5, 17, 300, 42, 9, 77], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True}
SLOW_CLIENTS = 520  # more than the global cap (512): before the fix they held every slot


def _error(r: httpx.Response | tuple[int, dict], status: int) -> dict:
    code, body = (r.status_code, r.json()) if isinstance(r, httpx.Response) else r
    assert code == status, (code, body)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def _connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect, so the window it advertises is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect((host, int(port)))
    return sock


def _head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """Status, JSON body and raw head of the one response on `sock` (bounded by its timeout)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    fields = dict(line.lower().split(b":", 1) for line in head.split(b"\r\n")[1:])
    length = int(fields[b"content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    return int(head.split()[1]), json.loads(rest[:length]), head


# -- the body, before anything else ------------------------------------------------------------

@pytest.fixture()
def gated():
    """A GatedClient's app (requests finish when the gate opens) with small caps to reach."""
    client = GatedClient()
    limits = HTTPLimits(body_read_timeout_s=2.0, max_in_flight_per_client=2, max_in_flight_per_key=2)
    with ServerThread(build_app(client, None, MODEL, api_key="key-a,key-b", max_queue=4, limits=limits)) as s:
        yield s, client
        client.gate.set()
        assert s.app.state.internal_errors == 0


AUTH = {"Authorization": "Bearer key-a"}


def test_lying_content_length_gets_a_prompt_413(gated):
    s, _ = gated
    with _connect(s.url) as sock:
        sock.sendall(_head("/v1/completions", {"Content-Length": "99999999999999", **AUTH}) + b'{"prompt"')
        status, body, head = _response(sock)
        assert _error((status, body), 413)["code"] == "request_too_large"
        assert b"connection: close" in head.lower()
    assert s.app.state.serving.in_flight == 0


def test_content_length_with_transfer_encoding_is_refused(gated):
    s, _ = gated
    body = json.dumps({"prompt": [5], "max_tokens": 1}).encode()
    with _connect(s.url) as sock:
        chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        sock.sendall(_head("/v1/completions", {"Content-Length": str(len(body)), "Transfer-Encoding": "chunked",
                                               **AUTH}) + chunked)
        status, err, _ = _response(sock)
        assert "Transfer-Encoding" in _error((status, err), 400)["message"]


def test_a_body_past_its_read_timeout_gets_408_and_holds_no_slot(gated):
    s, _ = gated
    with _connect(s.url) as sock:
        sock.sendall(_head("/v1/completions", {"Content-Length": "1000", **AUTH}) + b'{"prompt": [5]')
        assert s.app.state.serving.in_flight == 0  # the body is not in: no slot
        status, body, head = _response(sock)  # the server's 2 s read timeout ends it
        assert _error((status, body), 408)["code"] == "request_timeout"
        assert b"connection: close" in head.lower()
        assert sock.recv(1) == b""  # closed by the server
    assert s.app.state.serving.in_flight == 0


def _hold(http: httpx.Client, holding: list) -> None:
    """Start a stream that holds its slot (the gate is closed) and keep it open."""
    ctx = http.stream("POST", "/v1/completions", json={"prompt": [5], "max_tokens": 2, "stream": True,
                                                       "return_token_ids": True})
    r = ctx.__enter__()
    assert r.status_code == 200, r.read()
    lines = r.iter_lines()
    assert next(lines).startswith("data: {")
    holding.append((ctx, lines))


def test_per_client_and_per_key_caps_answer_429_below_the_global_cap(gated):
    s, client = gated
    holding: list = []
    other_address = httpx.HTTPTransport(local_address="127.0.0.2")  # another client on the loopback
    with httpx.Client(base_url=s.url, timeout=30, headers=AUTH) as a, \
            httpx.Client(base_url=s.url, timeout=30, headers=AUTH, transport=other_address) as b:
        _hold(a, holding)
        _hold(a, holding)  # client 127.0.0.1 at its cap of 2 (key-a too)
        err = _error(a.post("/v1/completions", json={"prompt": [5], "max_tokens": 2}), 429)
        assert err["type"] == "rate_limit_error" and "client address" in err["message"]
        # Another address with the same key: key-a is at its cap of 2.
        err = _error(b.post("/v1/completions", json={"prompt": [5], "max_tokens": 2}), 429)
        assert "API key" in err["message"]
        # The other key from the other address: under every cap, the global (4) included.
        b.headers["Authorization"] = "Bearer key-b"
        _hold(b, holding)
        _hold(b, holding)
        assert s.app.state.serving.in_flight == 4
        assert _error(b.post("/tokenize", json={"prompt": "hi"}), 429)["type"] == "rate_limit_error"
        client.gate.set()
        for ctx, lines in holding:
            assert [line for line in lines if line][-1] == "data: [DONE]"
            ctx.__exit__(None, None, None)
        wait_until(lambda: s.app.state.serving.in_flight == 0, 10, "every slot released")
        assert a.post("/v1/completions", json={"prompt": [5], "max_tokens": 2}).status_code == 200
        assert 'pdserve:http_requests_rejected_total{status="429"} 3.0' in a.get("/metrics").text


def test_one_shared_key_is_no_per_key_cap():
    """With a single API key the key names the deployment, not a user: only the other caps apply."""
    client = GatedClient()
    limits = HTTPLimits(max_in_flight_per_client=1, max_in_flight_per_key=1)
    holding: list = []
    with ServerThread(build_app(client, None, MODEL, api_key="only", max_queue=4, limits=limits)) as s, \
            httpx.Client(base_url=s.url, timeout=30, headers={"Authorization": "Bearer only"}) as a, \
            httpx.Client(base_url=s.url, timeout=30, headers={"Authorization": "Bearer only"},
                         transport=httpx.HTTPTransport(local_address="127.0.0.2")) as b:
        _hold(a, holding)
        _hold(b, holding)  # the same key from another address: served
        assert "client address" in _error(a.post("/v1/completions", json={"prompt": [5]}), 429)["message"]
        client.gate.set()
        for ctx, lines in holding:
            assert [line for line in lines if line][-1] == "data: [DONE]"
            ctx.__exit__(None, None, None)
        assert s.app.state.internal_errors == 0


def test_a_response_too_large_is_refused_up_front(gated):
    s, _ = gated
    # GatedClient's context is 64 tokens: the bound is reached with a small one.
    limits = HTTPLimits(max_response_entries=64 * 64 * 21 - 1)
    with ServerThread(build_app(GatedClient(), None, MODEL, limits=limits)) as small, \
            httpx.Client(base_url=small.url, timeout=30) as http:
        big = {"prompt": [5], "n": 64, "max_tokens": 64, "logprobs": 20}
        err = _error(http.post("/v1/completions", json=big), 400)
        assert err["param"] == "max_tokens" and str(limits.max_response_entries) in err["message"]
        # Without max_tokens a choice may run to the context: n is named.
        assert _error(http.post("/v1/completions", json=big | {"max_tokens": None}), 400)["param"] == "n"
        chat = {"messages": [{"role": "user", "content": "hi"}], "n": 64, "max_completion_tokens": 64,
                "logprobs": True, "top_logprobs": 20}
        # (no tokenizer here: the size check comes before the prompt is rendered)
        assert _error(http.post("/v1/chat/completions", json=chat), 400)["param"] == "max_completion_tokens"
        assert small.app.state.serving.in_flight == 0
        assert small.app.state.internal_errors == 0
    with ServerThread(build_app(GatedClient(), None, MODEL, limits=HTTPLimits(max_response_entries=1000))) as tiny, \
            httpx.Client(base_url=tiny.url, timeout=30) as http:
        one = {"input": "hi", "max_output_tokens": 64, "top_logprobs": 20}  # one choice: 64 x 21 = 1344
        assert _error(http.post("/v1/responses", json=one), 400)["param"] == "max_output_tokens"
        assert _error(http.post("/v1/responses", json=one | {"max_output_tokens": None}), 400)["param"] \
            == "max_output_tokens"
        assert tiny.app.state.internal_errors == 0
    # The default bound against a 4096-token context: the issue's 72 MB response (4 prompts x n=64 x
    # 500 tokens x 21) is refused; 2 prompts x n=64 x 4095 tokens (+1 prompt token) is within it and served.
    client = GatedClient()
    client.max_model_len = 4096
    client.gate.set()
    with ServerThread(build_app(client, None, MODEL)) as default, \
            httpx.Client(base_url=default.url, timeout=60) as http:
        issue = {"prompt": [[5]] * 4, "n": 64, "max_tokens": 500, "logprobs": 20}
        assert _error(http.post("/v1/completions", json=issue), 400)["param"] == "max_tokens"
        at_bound = {"prompt": [[5]] * 2, "n": 64, "max_tokens": 4095}
        assert 2 * 64 * 4095 <= HTTPLimits().max_response_entries < 2 * 64 * 4095 * 2
        assert _error(http.post("/v1/completions", json=at_bound | {"logprobs": 1}), 400)["param"] == "max_tokens"
        r = http.post("/v1/completions", json=at_bound)
        assert r.status_code == 200 and len(r.json()["choices"]) == 128, r.text
        assert default.app.state.internal_errors == 0


# -- against the bundled model ------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer):
    limits = HTTPLimits(max_stream_backlog=256)
    with served(tmp_path_factory.mktemp("limits"), "colocated", tokenizer, MODEL, app_options={"limits": limits},
                model=str(BUNDLED_MODEL), max_model_len=1024, block_size=16) as s:
        yield s


def test_slow_body_probe_a_normal_client_is_still_served(engine):
    """520 clients each send 10 of 1,000 announced bytes and hold their sockets: they hold
    connections, never serving slots, and a normal request is answered."""
    need = 2 * SLOW_CLIENTS + 256  # both ends of each socket live in this process
    assert raise_open_files_limit() >= need, "the open files limit is too low for the probe"
    connections = engine.server.server.server_state.connections
    before = set(connections)  # the uvicorn protocols of connections open already (keep-alive)
    slow: list[socket.socket] = []
    try:
        for _ in range(SLOW_CLIENTS):
            sock = _connect(engine.url)
            sock.sendall(_head("/v1/completions", {"Content-Length": "1000"}) + b'{"prompt":')
            slow.append(sock)
        wait_until(lambda: len(connections - before) >= SLOW_CLIENTS, 60, "every slow client accepted")
        probe = connections - before
        assert engine.server.app.state.serving.in_flight == 0
        with httpx.Client(base_url=engine.url, timeout=60) as http:
            r = http.post("/v1/completions", json=GREEDY)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8
        for sock in slow:  # each still held open, unanswered (not refused with a 429)
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)
    finally:
        for sock in slow:
            sock.close()
    wait_until(lambda: not probe & connections, 30, "the slow connections closed")
    assert engine.server.app.state.serving.in_flight == 0


def _metric(http: httpx.Client, line_start: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{line_start} not exported")


def test_a_client_that_stops_reading_is_aborted_and_the_engine_frees_it(engine):
    core = engine.engines["colocated-0"].core
    request = {"prompt": GREEDY["prompt"], "n": 4, "max_tokens": 1000, "logprobs": 20, "temperature": 0,
               "ignore_eos": True, "stream": True}
    body = json.dumps(request).encode()
    with httpx.Client(base_url=engine.url, timeout=60) as http:
        aborted_before = _metric(http, 'pdserve:request_success_total{finished_reason="abort"}')
        # Connections accepted from now on inherit a small send buffer (no autotuning), so what the
        # kernel holds for the client stays far below what the stream generates, on any box.
        engine.server.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32768)
        sock = _connect(engine.url, rcvbuf=4096)
        try:
            sock.sendall(_head("/v1/completions", {"Content-Length": str(len(body))}) + body)
            # ... and never reads: the server's buffers fill, then the stream's backlog passes its bound.
            wait_until(lambda: _metric(http, "pdserve:streams_aborted_slow_reader_total") == 1, 120,
                       "the slow reader's stream aborted")
            wait_until(lambda: not core.has_unfinished(), 30, "the engine to drop the aborted requests")
            wait_until(lambda: core.block_manager.num_free_blocks == core.block_manager.num_blocks, 30,
                       "every KV block free")
            assert _metric(http, 'pdserve:request_success_total{finished_reason="abort"}') == aborted_before + 4
            assert _metric(http, "pdserve:generation_tokens_total") < 4 * 1000  # cut short, not run to the end
            assert engine.server.app.state.serving.in_flight == 0
            # The server closed the connection: what the client finally reads ends.
            sock.settimeout(30)
            while sock.recv(65536):
                pass
        finally:
            sock.close()
        r = http.post("/v1/completions", json=GREEDY)  # the engine serves on
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


# -- the API document ----------------------------------------------------------------------------

def test_openapi_and_docs_are_served_with_the_request_models(gated):
    s, _ = gated
    with httpx.Client(base_url=s.url, timeout=30) as http:
        doc = http.get("/openapi.json").json()
        assert http.get("/docs").status_code == 200
    schemas = doc["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/v1/responses", "ResponsesRequest"), ("/detokenize", "DetokenizeRequest")):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
    assert {"prompt", "n", "max_tokens", "logprobs", "top_k"} <= set(schemas["CompletionRequest"]["properties"])
    assert {"messages", "max_completion_tokens", "top_logprobs"} <= set(schemas["ChatCompletionRequest"]["properties"])
    tokenize = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {r["$ref"].rsplit("/", 1)[1] for r in tokenize["anyOf"]} == {"TokenizeCompletionRequest",
                                                                         "TokenizeChatRequest"}
    assert "ChatMessage" in schemas  # nested models resolve
