"""The cluster key (issue 14, hole 7): with it the engine socket and the KV ports speak CURVE only,
so a process without the key can neither register as an engine nor pull KV, and a capture of the
traffic shows neither prompts nor keys; without it nothing listens beyond loopback."""
from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from conftest import random_prompts
from kv_harness import VOCAB, greedy
from pd_harness import ThreadedEngines, client_for, generate_all, running_client, wait_ready, wait_until
from tcp_relay import TcpRelay

from engine import messages as em
from engine.cluster_key import ClusterKey, check_bind
from engine.config import EngineConfig, KVTransferConfig
from kv_transfer import messages as m
from server.metrics import ServerMetrics

GREEDY = greedy(8)
KV_KEY = "kv-port-shared-key-0123456789"


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def run_pd_over_taps(model: str, tmp_path, key: ClusterKey | None, prompt: list[int], checks=None):
    """P and D (threads) reach the front end and each other over tapped loopback TCP. Returns the
    result and the captured bytes; `checks(client, prefill, fe_port)` runs while all is up."""
    # Every port is bound as :0 and the taps are pointed at what was bound: a port picked free
    # and bound later can meanwhile become the local port of an outgoing connection (the engines
    # dialling a tap), and the bind then fails.
    fe_tap, kv_tap = TcpRelay(target_port=0), TcpRelay(target_port=0)
    engines = ThreadedEngines(tmp_path)
    engines.server_addr = f"tcp://127.0.0.1:{fe_tap.port}"
    common = dict(model=model, max_model_len=256, num_threads=1)
    prefill = engines.add("prefill", "prefill-0", EngineConfig(**common),
                          KVTransferConfig(key=KV_KEY, addr="tcp://127.0.0.1:0",
                                           advertise=f"tcp://127.0.0.1:{kv_tap.port}"), cluster_key=key)
    kv_tap.target = port_of(prefill.connector.sender.address)
    engines.add("decode", "decode-0", EngineConfig(**common), KVTransferConfig(key=KV_KEY), cluster_key=key)
    client = client_for("tcp://127.0.0.1:0", model, "pd", 256, cluster_key=key)
    engines.start()
    try:
        with running_client(client) as run:
            fe_tap.target = port_of(client.router.address)
            run(wait_ready(client, timeout=30))
            (result,) = run(generate_all(client, [prompt], GREEDY, timeout=30))
            if checks is not None:
                checks(client, prefill, fe_tap.target)
    finally:
        engines.stop()
        fe_tap.close()
        kv_tap.close()
    return result, bytes(fe_tap.captured) + bytes(kv_tap.captured)


def test_with_the_cluster_key_traffic_is_encrypted(checkpoints, references, tmp_path):
    model = str(checkpoints["qwen2"])
    prompt = random_prompts(1, 48, 48, VOCAB, 145)[0]
    in_clear = msgspec.msgpack.encode(prompt)  # how a Submit carries the prompt
    plain, capture = run_pd_over_taps(model, tmp_path, None, prompt)
    assert plain["error"] is None and in_clear in capture and KV_KEY.encode() in capture  # the tap sees all
    key = ClusterKey.generate()
    result, capture = run_pd_over_taps(model, tmp_path, key, prompt)
    assert result["error"] is None
    references["qwen2"].assert_matches(prompt, result["tokens"], 8)
    assert len(capture) > 10_000  # the KV went through the tap too
    assert in_clear not in capture and KV_KEY.encode() not in capture and key.secret not in capture


def rogue_checks(client, prefill, fe_port: int) -> None:
    """A process without the cluster key tries to register as a prefill engine and to pull KV."""
    ctx = zmq.Context()
    impostors = []
    try:
        for keys in (None, zmq.curve_keypair()):  # no CURVE at all; CURVE with a key of its own
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, b"rogue-prefill")
            if keys is not None:
                sock.curve_serverkey = client.cluster_key.public  # public keys are not secrets
                sock.curve_publickey, sock.curve_secretkey = keys
            sock.connect(f"tcp://127.0.0.1:{fe_port}")
            impostors.append(sock)
            kv = ctx.socket(zmq.DEALER)
            kv.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                kv.curve_serverkey = client.cluster_key.public
                kv.curve_publickey, kv.curve_secretkey = keys
            kv.connect(prefill.connector.sender.address)
            impostors.append(kv)
        heartbeat = em.encode(em.Heartbeat("rogue-prefill", "prefill", "tcp://127.0.0.1:1", 9, 9, 0, 0, {}))
        hello = m.encode(m.Hello(prefill.connector.sender.compat_hash, "{}", "rogue-decode", KV_KEY))
        for _ in range(10):
            for i, sock in enumerate(impostors):
                try:
                    sock.send(hello if i % 2 else heartbeat, zmq.NOBLOCK)
                except zmq.Again:
                    pass  # no connection ever completes its handshake, so nothing can even be queued
            time.sleep(0.05)
        wait_until(lambda: client.refused_connections >= 2, 10, "the front end to count the refusals")
        assert "rogue-prefill" not in client.table
        assert all(kv.poll(500) == 0 for kv in impostors[1::2])  # no HelloAck, not even a reject
        assert len(prefill.connector.sender.peers) == 1  # the real decode engine only
        text = ServerMetrics(client.instances, client.counters).render().decode()
        assert "pdserve:engine_connections_refused_total" in text
    finally:
        for sock in impostors:
            sock.close(0)
        ctx.term()


def test_a_process_without_the_key_cannot_register_or_pull(checkpoints, tmp_path):
    model = str(checkpoints["qwen2"])
    prompt = random_prompts(1, 20, 20, VOCAB, 146)[0]
    result, _ = run_pd_over_taps(model, tmp_path, ClusterKey.generate(), prompt, checks=rogue_checks)
    assert result["error"] is None


def test_without_a_key_nothing_listens_beyond_loopback(monkeypatch):
    monkeypatch.delenv("PDSERVE_ALLOW_INSECURE", raising=False)
    with pytest.raises(ValueError, match="without a cluster key"):
        check_bind("tcp://0.0.0.0:5500", None, "front end")
    check_bind("tcp://127.0.0.1:5500", None, "front end")
    check_bind("ipc:///tmp/x", None, "front end")
    check_bind("tcp://0.0.0.0:5500", ClusterKey.generate(), "front end")
    monkeypatch.setenv("PDSERVE_ALLOW_INSECURE", "1")
    check_bind("tcp://0.0.0.0:5500", None, "front end")


def test_cluster_key_from_file_and_env(tmp_path, monkeypatch):
    key = ClusterKey.generate()
    (tmp_path / "key").write_text(key.secret.decode() + "\n")
    assert ClusterKey.from_env({"PDSERVE_CLUSTER_KEY_FILE": str(tmp_path / "key")}) == key
    assert ClusterKey.from_env({"PDSERVE_CLUSTER_KEY": key.secret.decode()}) == key
    assert ClusterKey.from_env({}) is None
    with pytest.raises(ValueError, match="40 z85 characters"):
        ClusterKey.from_env({"PDSERVE_CLUSTER_KEY": "short"})
