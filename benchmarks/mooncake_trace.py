"""Mooncake-format traces for `pdserve bench --dataset-name mooncake`: read one, turn it into token-id
prompts with shared prefixes, and write a synthetic one (scripts/make_mooncake_trace.py).

A trace is JSONL, one request a line: `timestamp` (ms since the trace began), `input_length`,
`output_length` (tokens) and `hash_ids`, one id per block of `block_size` prompt tokens (512 in
Mooncake's published traces). Equal hash ids stand for equal blocks, and a block's hash covers
everything before it too, so two requests that share their first k hash ids share a k-block prefix.
The tokens of a block are a pure function of (seed, hash id): every request holding that id gets the
same tokens, which is what lets the server's prefix cache find the sharing the trace describes."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK_SIZE = 512
# Seed tags that keep a block's tokens apart from any other seeded stream: numpy's SeedSequence([s, 0])
# equals SeedSequence(s), so untagged, hash id 0 would repeat the random dataset's prompt of seed s.
_BLOCK_STREAM = 0x6D6F6F6E
_TAIL_STREAM = 0x7461696C  # tokens past a request's last hash block: the request's own


@dataclass(frozen=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _row(obj: dict, where: str) -> TraceRow:
    try:
        hash_ids = tuple(int(h) for h in obj.get("hash_ids") or ())
        row = TraceRow(float(obj["timestamp"]), int(obj["input_length"]), int(obj["output_length"]), hash_ids)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: expected timestamp, input_length, output_length and hash_ids ({e!r})") from None
    if row.input_length < 1 or row.output_length < 1 or any(h < 0 for h in hash_ids):
        raise ValueError(f"{where}: lengths must be >= 1 and hash ids >= 0")
    return row


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRow]:
    """The first `limit` requests of a trace file (all when None), in timestamp order."""
    rows: list[TraceRow] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(rows) >= limit:
                break
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None
            rows.append(_row(obj, f"{path}:{lineno}"))
    return sorted(rows, key=lambda r: r.timestamp_ms)


def block_tokens(hash_id: int, block_size: int, allowed: np.ndarray, seed: int) -> list[int]:
    """The `block_size` tokens that hash id `hash_id` stands for (the same in every request)."""
    rng = np.random.default_rng([_BLOCK_STREAM, seed, hash_id])
    return allowed[rng.integers(0, len(allowed), size=block_size)].tolist()


def trace_prompt(row: TraceRow, index: int, block_size: int, allowed: np.ndarray, seed: int) -> list[int]:
    """`input_length` tokens: the row's blocks in order, cut to length; a prompt longer than its
    blocks ends in tokens of its own (request `index`)."""
    tokens: list[int] = []
    for h in row.hash_ids:
        if len(tokens) >= row.input_length:
            break
        tokens += block_tokens(h, block_size, allowed, seed)
    missing = row.input_length - len(tokens)
    if missing > 0:
        rng = np.random.default_rng([_TAIL_STREAM, seed, index])
        tokens += allowed[rng.integers(0, len(allowed), size=missing)].tolist()
    return tokens[:row.input_length]


def send_offsets(rows: list[TraceRow], speedup: float) -> list[float]:
    """Seconds from the run's start at which each row is sent: its timestamp, relative to the first,
    divided by `speedup` (2 replays the trace twice as fast)."""
    if speedup <= 0:
        raise ValueError(f"--trace-speedup must be > 0, got {speedup}")
    if not rows:
        return []
    t0 = rows[0].timestamp_ms
    return [(r.timestamp_ms - t0) / 1000.0 / speedup for r in rows]


def synthetic_trace(num_requests: int, num_prefixes: int, prefix_blocks: int, unique_blocks: int,
                    output_length: int, rate: float, block_size: int, seed: int) -> list[dict]:
    """Requests in `num_prefixes` groups (say, system prompts or documents): each request's first
    `prefix_blocks` hash ids are its group's, then `unique_blocks` of its own; its last block is cut
    short by a random amount, as real prompts rarely end on a block boundary. Poisson arrivals at
    `rate` requests per second."""
    rng = np.random.default_rng(seed)
    next_id = num_prefixes * prefix_blocks  # ids below are the groups' shared blocks
    rows, t = [], 0.0
    for _ in range(num_requests):
        group = int(rng.integers(num_prefixes))
        hash_ids = list(range(group * prefix_blocks, (group + 1) * prefix_blocks))
        hash_ids += list(range(next_id, next_id + unique_blocks))
        next_id += unique_blocks
        cut = int(rng.integers(0, block_size // 2)) if unique_blocks else 0
        rows.append({"timestamp": int(round(t * 1000)), "input_length": len(hash_ids) * block_size - cut,
                     "output_length": output_length, "hash_ids": hash_ids})
        t += float(rng.exponential(1.0 / rate))
    return rows


def write_trace(path: str | Path, rows: list[dict]) -> None:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
