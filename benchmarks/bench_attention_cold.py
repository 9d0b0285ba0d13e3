"""The C++ paged-attention kernel at real size, its cache cold: a decode step's attention on Qwen3-0.6B's
shapes (16 query / 8 KV heads of 128: a slot of the cache is a 4 KiB page; `--shapes bundled`: the
bundled model's 4 / 2 heads of 64, a 512-byte slot), 28 layers' caches visited in turn as a step
does (together larger than the L3), against the same layers' calls on one cache (hot) and a plain
torch sum over the same bytes (what reading them costs at this machine's speed).

Random contexts around --ctx tokens, 16-token blocks scattered through each cache as in a serving
engine, --q-len query tokens a row (1: decode, more: verifying drafts). Run it in two checkouts to
compare kernels; the median of --reps is printed, per layer.

    python benchmarks/bench_attention_cold.py [--shapes qwen3-0.6b|bundled] [--batch 8] [--ctx 232]
        [--q-len 1] [--threads 2] [--reps 7] [--avx2]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import median_seconds  # noqa: E402

SHAPES = {"qwen3-0.6b": (16, 8, 128), "bundled": (4, 2, 64)}  # query heads, KV heads, head_dim
BLOCK, LAYERS = 16, 28


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=list(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--q-len", type=int, default=1)
    parser.add_argument("--ctx", type=int, default=232)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--avx2", action="store_true", help="build the kernel without AVX-512 (its AVX2 path)")
    args = parser.parse_args()
    from worker import cpp_build, cpu_attention

    flags = cpu_attention.CFLAGS + (["-mno-avx512f"] if args.avx2 else [])
    assert cpp_build.build("paged_attention.cpp", flags, "paged attention"), "the kernel did not build"
    torch.set_num_threads(args.threads)
    HEADS, KV_HEADS, DIM = SHAPES[args.shapes]
    gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    lens = rng.integers(args.ctx - 30, args.ctx + 30, size=args.batch)
    blocks = (lens + BLOCK - 1) // BLOCK
    num_blocks = int(blocks.sum()) + 64
    order = torch.randperm(num_blocks, generator=gen).int()
    table = torch.zeros(args.batch, int(blocks.max()), dtype=torch.int32)
    for b, start in enumerate(np.cumsum(blocks) - blocks):
        table[b, :blocks[b]] = order[start:start + blocks[b]]
    caches = [tuple(torch.randn(num_blocks * BLOCK, KV_HEADS, DIM, generator=gen) for _ in range(2))
              for _ in range(LAYERS)]
    q = torch.randn(args.batch * args.q_len, HEADS, DIM, generator=gen)
    starts, q_lens = torch.arange(args.batch, dtype=torch.int32) * args.q_len, torch.full((args.batch,), args.q_len,
                                                                                            dtype=torch.int32)
    out = torch.empty_like(q)

    def attend(layers) -> None:
        for k, v in layers:
            torch.ops.pdserve_cpu.paged_attention(q, k, v, table, starts, q_lens,
                                                  torch.tensor(lens, dtype=torch.int32), BLOCK, 0, DIM ** -0.5, out)

    tokens = int(lens.sum())
    nbytes = tokens * KV_HEADS * DIM * 4 * 2
    flat = [torch.cat([k[:tokens], v[:tokens]]) for k, v in caches]
    cold = median_seconds(lambda: attend(caches), args.reps) / LAYERS
    hot = median_seconds(lambda: attend([caches[0]] * LAYERS), args.reps) / LAYERS
    read = median_seconds(lambda: [x.sum() for x in flat], args.reps) / LAYERS
    build = " (AVX2 build)" if args.avx2 else ""
    print(f"{args.shapes}{build} batch {args.batch} q_len {args.q_len} ctx~{args.ctx} threads {args.threads}, "
          f"per layer: cold {cold * 1e6:.0f} us "
          f"({nbytes / cold / 1e9:.1f} GB/s), hot {hot * 1e6:.0f} us, a plain read of its "
          f"{nbytes / 2**20:.1f} MiB {read * 1e6:.0f} us ({nbytes / read / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
