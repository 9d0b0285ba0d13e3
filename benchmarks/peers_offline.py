"""Offline-throughput worker for benchmarks/bench_peers.py: one engine, one process.

    PYTHON benchmarks/peers_offline.py SPEC.json RESULT.json

Run by pdserve's Python (engine `pdserve`: `engine.LLM`) or by the vLLM venv's Python (engine
`vllm`: `vllm.LLM`), so this file imports nothing of either at module level, and nothing of
pdserve at all on the vLLM side. SPEC.json (written by bench_peers.py) holds the engine name, the
checkpoint, the engine arguments both sides share, and the workloads as token-id prompts, so both
engines run exactly the same requests. RESULT.json gets, per workload, the wall time of one
`generate` call over all its prompts and the output tokens it produced.

vLLM's engine starts worker processes with multiprocessing spawn, which re-imports the main module:
everything runs under `if __name__ == "__main__"`.
"""
from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger("peers_offline")
TIMED_CALLS = 3  # timed generate calls per workload; the median counts

# generate(prompts, max_tokens) -> output token count per prompt
Generate = Callable[[list[list[int]], int], list[int]]


def pdserve_engine(spec: dict[str, Any]) -> tuple[Generate, Callable[[], None]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from engine import LLM, SamplingParams

    llm = LLM(spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], speculative_method=None)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [len(o.token_ids) for o in llm.generate(prompts, params)]

    return generate, llm.shutdown


def vllm_engine(spec: dict[str, Any]) -> tuple[Generate, Callable[[], None]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], seed=0)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    def shutdown() -> None:
        # Not every vLLM version has LLM.shutdown; the engine core process also exits with us.
        getattr(llm, "shutdown", lambda: None)()

    return generate, shutdown


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path(sys.argv[1]).read_text())
    t0 = time.perf_counter()
    generate, shutdown = {"pdserve": pdserve_engine, "vllm": vllm_engine}[spec["engine"]](spec)
    startup = time.perf_counter() - t0
    results: dict[str, Any] = {"engine": spec["engine"], "startup_s": startup, "workloads": {}}
    try:
        for wl in spec["workloads"]:
            prompts, max_tokens = wl["prompts"], wl["max_tokens"]
            # Warm-up on a slice of the same workload: lazy initialisation, first-shape compiles and
            # allocator growth are paid before the clock starts, for both engines alike.
            generate(prompts[: min(len(prompts), 8)], min(max_tokens, 8))
            # The median of TIMED_CALLS calls: a 64 x 64 call lasts about a second, and one call's
            # ratio swung 0.86-1.11 between rounds on this box.
            elapsed_each = []
            for _ in range(TIMED_CALLS):
                t = time.perf_counter()
                counts = generate(prompts, max_tokens)
                elapsed_each.append(time.perf_counter() - t)
                if any(c != max_tokens for c in counts):  # ignore_eos: anything else is a broken run
                    raise RuntimeError(f"{spec['engine']} {wl['name']}: output lengths {sorted(set(counts))}, "
                                       f"expected {max_tokens} each")
            elapsed = statistics.median(elapsed_each)
            total = sum(counts)
            results["workloads"][wl["name"]] = {"elapsed_s": elapsed, "elapsed_each_s": elapsed_each,
                                                "output_tokens": total, "output_tok_s": total / elapsed}
            logger.info("%s %s: %d tokens in %.2f s = %.1f tok/s", spec["engine"], wl["name"], total, elapsed,
                        total / elapsed)
    finally:
        shutdown()
    Path(sys.argv[2]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
