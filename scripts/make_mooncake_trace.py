"""Write a small synthetic Mooncake-format trace (JSONL: timestamp ms, input_length, output_length,
hash_ids) whose requests share prompt prefixes, for `pdserve bench --dataset-name mooncake`.

    python scripts/make_mooncake_trace.py trace.jsonl --num-requests 40 --num-prefixes 4 \\
        --prefix-blocks 2 --unique-blocks 1 --block-size 512 --output-length 64 --rate 2
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from benchmarks.mooncake_trace import MOONCAKE_BLOCK_SIZE, synthetic_trace, write_trace  # noqa: E402

logger = logging.getLogger("make_mooncake_trace")


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="trace file to write (JSONL)")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--num-prefixes", type=int, default=4, help="groups of requests sharing a prefix")
    p.add_argument("--prefix-blocks", type=int, default=2, help="shared blocks at the start of every prompt")
    p.add_argument("--unique-blocks", type=int, default=1, help="blocks of each prompt's own after the prefix")
    p.add_argument("--block-size", type=int, default=MOONCAKE_BLOCK_SIZE, help="tokens per hash id")
    p.add_argument("--output-length", type=int, default=64)
    p.add_argument("--rate", type=float, default=2.0, help="mean requests per second (Poisson)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rows = synthetic_trace(a.num_requests, a.num_prefixes, a.prefix_blocks, a.unique_blocks, a.output_length,
                           a.rate, a.block_size, a.seed)
    write_trace(a.out, rows)
    logger.info("wrote %d requests to %s", len(rows), a.out)
    return a.out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
