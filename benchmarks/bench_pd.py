"""PD benchmarks, printed side by side in one run.

(a) KV transfer throughput: pdserve's sender/receiver (handshake, header, one frame per layer,
    write into the decode cache, ack), with and without the xxh3 payload checksum, vs a raw ZMQ
    stream of the same bytes over the same transport.
(b) TTFT and inter-token latency p50/p99, PD vs colocated, while long prompts keep arriving
    during decodes (streaming HTTP against `pdserve serve`, each mode on the same 2 cores).
(c) The KV hand-off, layer-wise vs after-prefill (--kv-transfer-mode): time from P writing the
    prompt's last KV layer to D's first decode step of the request (D's
    kv_transfer_handoff_seconds, wall clock on one host), plus TTFT and ITL, on ~1.5k-token
    prompts sent one at a time; both servers run side by side and the rounds alternate modes.

    python benchmarks/bench_pd.py [--skip-transfer] [--skip-latency] [--skip-handoff] [--model DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import zmq  # noqa: E402

from benchmarks.common import mixed_prompts, pct, resolve_model  # noqa: E402
from kv_transfer.receiver import KVReceiver  # noqa: E402
from kv_transfer.sender import KVSender  # noqa: E402
from server.procs import start_tied, stop_process_group  # noqa: E402

# -- (a) transfer throughput -------------------------------------------------------------------

def bench_transfer(transport: str, layers: int, blocks_per_req: int, num_reqs: int,
                   checksum: bool = True) -> tuple[float, float, int]:
    shape = (layers, 2, blocks_per_req * 4, 16, 8, 64)  # [layers, k/v, blocks, block_size, kv_heads, head_dim]
    src = torch.randn(shape)
    dst = torch.zeros(shape)
    ctx = zmq.Context()
    tmp = tempfile.mkdtemp()
    addr = f"ipc://{tmp}/kv" if transport == "ipc" else "tcp://127.0.0.1:0"
    sender = KVSender(ctx, addr, src, "h", "d", "p", release_blocks=lambda *_: None, checksum=checksum)
    receiver = KVReceiver(ctx, dst, "h", "d", "d", verify_checksums=checksum)
    blocks = list(range(blocks_per_req))
    nbytes = layers * 2 * blocks_per_req * 16 * 8 * 64 * 4
    start = time.perf_counter()
    poller = zmq.Poller()
    poller.register(sender.socket, zmq.POLLIN)
    for i in range(num_reqs):
        sender.hold(f"r{i}", blocks, blocks_per_req * 16, 1)
        receiver.start(f"r{i}", sender.address, blocks)
        if i == 0:
            for sock in receiver.sockets():
                poller.register(sock, zmq.POLLIN)
        done: list = []
        while not done:
            poller.poll(10)  # block like the engine loop does, instead of spinning
            sender.poll()
            done, failed = receiver.poll()
            assert not failed, failed
    kv_s = time.perf_counter() - start
    assert torch.equal(dst[:, :, :blocks_per_req], src[:, :, :blocks_per_req])

    # Raw: the same frames (one per layer) pushed over the same transport, each copied into place.
    push, pull = ctx.socket(zmq.DEALER), ctx.socket(zmq.ROUTER)
    raw_addr = f"ipc://{tmp}/raw" if transport == "ipc" else "tcp://127.0.0.1:0"
    pull.bind(raw_addr)
    push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))
    frames = [memoryview(src[layer][:, :blocks_per_req].contiguous().numpy()) for layer in range(layers)]
    start = time.perf_counter()
    for _ in range(num_reqs):
        push.send_multipart(frames, copy=False)
        got = pull.recv_multipart(copy=False)
        for layer, f in enumerate(got[1:]):
            part = dst[layer][:, :blocks_per_req]
            part.copy_(torch.frombuffer(f.buffer, dtype=torch.float32).view(part.shape))
    raw_s = time.perf_counter() - start
    for s in (push, pull):
        s.close(0)
    sender.close()
    receiver.close()
    ctx.term()
    return kv_s, raw_s, nbytes * num_reqs


# -- (b) latency under interference -------------------------------------------------------------

def start_server(model: str, mode: str, port: int, extra: list[str]) -> subprocess.Popen:
    argv = [sys.executable, "-m", "server.cli", "serve", "--model", model, "--mode", mode, "--port", str(port),
            "--max-model-len", "2048", "--max-num-batched-tokens", "512", *extra]
    env = dict(os.environ, PDSERVE_LOG_LEVEL="WARNING")
    return start_tied(argv, cwd=REPO, env=env, start_new_session=True, stdout=subprocess.DEVNULL)


async def stream_one(client, url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """Returns (TTFT, inter-token gaps) of one streaming completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    stamps.append(time.perf_counter())
    ttft = stamps[0] - start
    return ttft, [b - a for a, b in zip(stamps, stamps[1:])]


async def interference_workload(url: str, vocab: int, seconds: float) -> dict:
    import httpx

    async with httpx.AsyncClient() as client:
        for _ in range(300):  # wait for /health
            try:
                if (await client.get(f"{url}/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
        short = mixed_prompts(8, vocab, 16, 32, seed=1)
        long = mixed_prompts(64, vocab, 1024, 1536, seed=2)
        ttft_short, ttft_long, itl = [], [], []
        stop = time.perf_counter() + seconds

        async def decoder(p):
            while time.perf_counter() < stop:
                t, gaps = await stream_one(client, url, p, 64)
                ttft_short.append(t)
                itl.extend(gaps)

        async def long_arrivals():
            i = 0
            tasks = []
            while time.perf_counter() < stop:
                tasks.append(asyncio.create_task(stream_one(client, url, long[i % len(long)], 4)))
                i += 1
                await asyncio.sleep(1.0)
            for t, _ in await asyncio.gather(*tasks):
                ttft_long.append(t)

        await asyncio.gather(*(decoder(p) for p in short), long_arrivals())
    return {"ttft_short": ttft_short, "ttft_long": ttft_long, "itl": itl}


def bench_latency(model: str, seconds: float, spec: str) -> dict[str, dict]:
    from engine.config import ModelConfig

    vocab = ModelConfig.from_dir(model).vocab_size
    results = {}
    for mode in ("pd", "colocated"):
        port = 18000 + (os.getpid() % 1000) + (0 if mode == "pd" else 1)
        proc = start_server(model, mode, port, ["--speculative-method", spec])
        try:
            results[mode] = asyncio.run(interference_workload(f"http://127.0.0.1:{port}", vocab, seconds))
        finally:
            stop_process_group(proc)
    return results


# -- (c) the hand-off, layer-wise vs after-prefill ----------------------------------------------

HANDOFF_MODES = ("layerwise", "after-prefill")


async def handoff_sums(client, url: str) -> tuple[float, float]:
    """D's kv_transfer_handoff_seconds (sum, count) from /metrics."""
    text = (await client.get(f"{url}/metrics")).text
    found = {}
    for what in ("sum", "count"):
        pattern = rf'kv_transfer_handoff_seconds_{what}(?:_total)?{{[^}}]*role="decode"[^}}]*}} ([0-9.e+-]+)'
        found[what] = sum(float(v) for v in re.findall(pattern, text))
    return found["sum"], found["count"]


async def handoff_round(url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    import httpx

    async with httpx.AsyncClient() as client:
        before = await handoff_sums(client, url)
        ttft, itl, first_gap = [], [], []
        for prompt in prompts:  # one at a time: the hand-off alone, no queueing behind other requests
            t, gaps = await stream_one(client, url, prompt, max_tokens)
            ttft.append(t)
            itl.extend(gaps)
            first_gap.append(gaps[0])
        await asyncio.sleep(0.6)  # D's counters reach the front end with its next heartbeat (0.2 s)
        after = await handoff_sums(client, url)
    count = after[1] - before[1]
    assert count == len(prompts), f"{count} hand-offs measured for {len(prompts)} requests"
    return {"handoff": (after[0] - before[0]) / count, "ttft": ttft, "itl": itl, "first_gap": first_gap}


async def wait_health(url: str) -> None:
    import httpx

    async with httpx.AsyncClient() as client:
        for _ in range(600):
            try:
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} never became healthy")


def bench_handoff(model: str, rounds: int, per_round: int, spec: str) -> dict[str, list[dict]]:
    from engine.config import ModelConfig

    vocab = ModelConfig.from_dir(model).vocab_size
    prompts = mixed_prompts(rounds * per_round + 1, vocab, 1400, 1600, seed=3)
    base = 19000 + (os.getpid() % 500) * 2
    urls = {mode: f"http://127.0.0.1:{base + i}" for i, mode in enumerate(HANDOFF_MODES)}
    procs = [start_server(model, "pd", base + i, ["--kv-transfer-mode", mode, "--speculative-method", spec,
                                                  "--no-enable-prefix-caching"])
             for i, mode in enumerate(HANDOFF_MODES)]
    results: dict[str, list[dict]] = {mode: [] for mode in HANDOFF_MODES}
    try:
        for url in urls.values():
            asyncio.run(wait_health(url))
            asyncio.run(handoff_round(url, prompts[-1:], 4))  # warm-up: first forwards load kernels
        for r in range(rounds):
            order = HANDOFF_MODES if r % 2 == 0 else HANDOFF_MODES[::-1]
            for mode in order:  # the same prompts for both modes in a round
                results[mode].append(asyncio.run(handoff_round(urls[mode], prompts[r * per_round:(r + 1) * per_round],
                                                               16)))
    finally:
        for proc in procs:
            stop_process_group(proc)
    return results


def print_handoff(res: dict[str, list[dict]], rounds: int, per_round: int, spec: str) -> None:
    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in res[mode]) * 1000

    def pooled(mode: str, key: str, q: float) -> float:
        return pct([v for r in res[mode] for v in r[key]], q) * 1000

    print(f"\n(c) KV hand-off on 1400-1600-token prompts, one request at a time, {rounds} rounds x {per_round} "
          f"requests per mode, modes alternating (spec={spec}, 512-token prefill chunks, 1 thread P + 1 thread D)")
    print(f"{'metric':<44}{'layerwise':>11}{'after-prefill':>15}{'ratio':>8}")
    a, b = med("layerwise", "handoff"), med("after-prefill", "handoff")
    print(f"{'P last KV layer -> D first step, median (ms)':<44}{a:>11.2f}{b:>15.2f}{a / b:>8.2f}")
    for key, label in (("ttft", "TTFT"), ("first_gap", "t0 -> first D token"), ("itl", "ITL")):
        for q in (50, 99):
            a, b = pooled("layerwise", key, q), pooled("after-prefill", key, q)
            print(f"{label + f' p{q} (ms)':<44}{a:>11.2f}{b:>15.2f}{a / b:>8.2f}")
    for mode in HANDOFF_MODES:
        print(f"{mode}: hand-off per round (ms) " + " ".join(f"{r['handoff'] * 1000:.2f}" for r in res[mode]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model")
    ap.add_argument("--skip-transfer", action="store_true")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--skip-handoff", action="store_true")
    ap.add_argument("--handoff-rounds", type=int, default=5)
    ap.add_argument("--handoff-requests", type=int, default=4, help="requests per round and mode")
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--speculative-method", default="none")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as in an engine process on this 2-core box
    if not args.skip_transfer:
        print("(a) KV transfer vs raw ZMQ, same bytes, same transport (single-threaded ping-pong, write into place)")
        print(f"{'transport':<10}{'MB/req':>8}{'checksum GB/s':>15}{'no-sum GB/s':>13}{'raw GB/s':>10}"
              f"{'sum/raw':>9}{'nosum/raw':>11}")
        for transport in ("ipc", "tcp"):
            for blocks in (4, 64):
                on_s, raw_s, total = bench_transfer(transport, layers=8, blocks_per_req=blocks, num_reqs=40)
                off_s, raw2_s, _ = bench_transfer(transport, layers=8, blocks_per_req=blocks, num_reqs=40,
                                                  checksum=False)
                raw_s = min(raw_s, raw2_s)  # the faster of the two raw runs: the stricter baseline
                mb = total / 40 / 1e6
                print(f"{transport:<10}{mb:>8.1f}{total / on_s / 1e9:>15.2f}{total / off_s / 1e9:>13.2f}"
                      f"{total / raw_s / 1e9:>10.2f}{raw_s / on_s:>9.2f}{raw_s / off_s:>11.2f}")
    if not args.skip_handoff:
        res = bench_handoff(resolve_model(args.model), args.handoff_rounds, args.handoff_requests,
                            args.speculative_method)
        print_handoff(res, args.handoff_rounds, args.handoff_requests, args.speculative_method)
    if not args.skip_latency:
        model = resolve_model(args.model)
        res = bench_latency(model, args.seconds, args.speculative_method)
        print(f"\n(b) latency while 1024-1536-token prompts arrive every second during 8 decoding streams "
              f"({args.seconds:.0f} s per mode, spec={args.speculative_method}); PD: 1 thread P + 1 thread D, "
              f"colocated: 2 threads")
        print(f"{'metric':<22}{'PD':>10}{'colocated':>11}{'PD/colo':>9}")
        for key, label in (("ttft_short", "TTFT short"), ("ttft_long", "TTFT long"), ("itl", "ITL")):
            for q in (50, 99):
                a, b = pct(res["pd"][key], q) * 1000, pct(res["colocated"][key], q) * 1000
                print(f"{label + f' p{q} (ms)':<22}{a:>10.1f}{b:>11.1f}{a / b:>9.2f}")
        for mode in ("pd", "colocated"):
            print(f"{mode}: {len(res[mode]['ttft_short'])} decode streams, {len(res[mode]['ttft_long'])} long prompts, "
                  f"{len(res[mode]['itl'])} token gaps")


if __name__ == "__main__":
    main()
