"""The C++ prefill attention kernel against torch's SDPA (what it replaced): one layer's causal
attention of a prompt over its own tokens, q a strided view of a fused QKV projection as in the
model, on Qwen3-0.6B's shapes (16 query / 8 KV heads of 128) and the bundled model's (4 / 2 of 64).
Both run alternately, --rounds times; each cell is the median of the rounds' medians.

    python benchmarks/bench_prefill_attention.py [--lengths 200,512,1400,2048] [--threads 2] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import median_seconds  # noqa: E402

SHAPES = {"0.6b": (16, 8, 128), "bundled": (4, 2, 64)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="200,512,1400,2048")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from worker import cpu_attention

    assert cpu_attention.prefill_available(), "the kernel did not build"
    torch.set_num_threads(args.threads)
    print(f"prefill attention, {args.threads} thread(s), median of {args.rounds} alternating rounds")
    for name, (heads, kv_heads, dim) in SHAPES.items():
        for length in map(int, args.lengths.split(",")):
            qkv = torch.randn(length, (heads + 2 * kv_heads) * dim)
            q = qkv[:, : heads * dim].view(length, heads, dim)
            k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(length, kv_heads, dim)
            v = qkv[:, (heads + kv_heads) * dim :].view(length, kv_heads, dim)
            out = torch.empty(length, heads, dim)

            def sdpa(q=q, k=k, v=v) -> torch.Tensor:
                def heads_first(x: torch.Tensor) -> torch.Tensor:
                    return x.transpose(0, 1).unsqueeze(0)

                return F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v),
                                                      is_causal=True, enable_gqa=True)[0].transpose(0, 1)

            def ours(q=q, k=k, v=v, out=out, dim=dim) -> torch.Tensor:
                cpu_attention.prefill_attention(q, k, v, dim ** -0.5, out)
                return out

            diff = float((sdpa() - ours()).abs().max())
            times: dict[str, list[float]] = {"sdpa": [], "ours": []}
            for r in range(args.rounds):
                for way in (("sdpa", sdpa), ("ours", ours))[:: 1 if r % 2 == 0 else -1]:
                    times[way[0]].append(median_seconds(way[1], 5))
            a, b = statistics.median(times["sdpa"]), statistics.median(times["ours"])
            flop = 4 * heads * dim * length * (length + 1) / 2  # the causal half's QK^T and PV
            print(f"  {name:8s} T={length:5d}  sdpa {a * 1e3:8.2f} ms ({flop / a / 1e9:4.0f} GFLOP/s)  "
                  f"ours {b * 1e3:8.2f} ms ({flop / b / 1e9:4.0f} GFLOP/s)  sdpa/ours {a / b:.2f}x  "
                  f"max|diff| {diff:.1e}")


if __name__ == "__main__":
    main()
