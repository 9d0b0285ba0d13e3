"""x-request-id and /v1/models' `created` (issue 48 item 3), against `pdserve serve` (PD + MTP).

Every response carries x-request-id: the client's, echoed, or a fresh one; the generation routes
name their engine requests after it, which their `id` shows."""
from __future__ import annotations

import time
import uuid

import httpx
from structured_harness import MODEL

GENERATIONS = [("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, "cmpl"),
               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                "chatcmpl"),
               ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}, "resp")]


def test_request_id_is_echoed_and_names_the_request(servers):
    url = servers.served["pd_mtp"].url
    for path, body, prefix in GENERATIONS:
        for stream in (False, True):
            rid = f"client-{uuid.uuid4().hex[:8]}.try:1"
            r = httpx.post(url + path, json={"model": MODEL, "stream": stream, **body},
                           headers={"x-request-id": rid}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"] == rid
            if not stream:
                assert r.json()["id"] == f"{prefix}-{rid}"
            else:
                assert f'"id":"{prefix}-{rid}"' in r.text


def test_request_id_is_generated_on_every_response(servers):
    url = servers.served["pd_mtp"].url
    answers = [httpx.get(url + "/health", timeout=10), httpx.get(url + "/metrics", timeout=10),
               httpx.get(url + "/v1/models", timeout=10), httpx.get(url + "/no/such/route", timeout=10),
               httpx.post(url + "/v1/chat/completions", content=b"{not json", timeout=10),
               httpx.post(url + "/v1/responses", json={"input": "Hi", "previous_response_id": "r"}, timeout=10)]
    assert [a.status_code for a in answers] == [200, 200, 200, 404, 400, 400]
    ids = [a.headers.get("x-request-id") for a in answers]
    assert all(ids) and len(set(ids)) == len(ids), ids
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"]


def test_bad_request_id_is_a_400(servers):
    url = servers.served["pd_mtp"].url
    for bad in ("x" * 300, "two words"):
        r = httpx.get(url + "/v1/models", headers={"x-request-id": bad}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id"


def test_models_created_is_the_load_time(servers):
    url = servers.served["colocated"].url
    cards = [httpx.get(url + "/v1/models", timeout=10).json()["data"][0],
             httpx.get(url + f"/v1/models/{MODEL}", timeout=10).json()]
    created = {c["created"] for c in cards}
    assert len(created) == 1
    assert 0 < created.pop() <= time.time()
