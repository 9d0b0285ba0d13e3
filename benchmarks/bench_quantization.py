"""Batch-1 decode step time with fp32, bf16 and int8 weights, on a checkpoint of real shapes, and
the memory bandwidth of the box to hold the achieved weight bytes/s against.

Per torch thread count, one process loads every variant side by side (one engine each, one request)
and times them in turn, rep after rep: a 16-token prompt, then N decode steps, each EngineCore.step
timed; a variant's step time is the median step of a rep, the fastest rep of --reps (the box is
shared: a neighbour's load only ever adds time). Weight bytes per step: every linear's weight as
stored (int8 + its scales, bf16, fp32), which a batch-1 step reads once; the embedding (a row a
step) is left out. The int8 variants are one engine whose linears switch kernel (Linear.int8_way):
ours (worker/csrc/linear_kernels.cpp), torch's aten._weight_int8pack_mm with the fp32 activations,
or linear_widening at every row count (the int8 weight dequantized a block of output features at a
time, then oneDNN's GEMM: what the engine does above NARROW_MAX_ROWS rows). Then the same ways per
linear, one row through 8 layers' worth of Qwen3-0.6B shapes (with torchao itself where it is
importable), and the machine probes: a 512 MiB tensor copy (read + written bytes) and a sum over it
(read bytes), best of 5, and an fp32 GEMM of 2048^3 (the compute peak a prefill step can hope for),
best of 5. Each variant's prefill step (one PREFILL_TOKENS-token prompt, fastest of the reps) is
reported in GFLOP/s against that peak: linears 2 * in * out per token, attention 4 * head_dim *
heads per (query, key) pair of the causal prompt.

    python scripts/make_random_checkpoint.py /tmp/q06 --preset qwen3-0.6b
    python benchmarks/bench_quantization.py /tmp/q06 --threads 1 2 [--out benchmarks/results/quantization.md]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# name: (engine arguments, int8 kernel forced on every int8 linear, or None)
VARIANTS: dict[str, tuple[dict, str | None]] = {
    "fp32": ({}, None),
    "bf16": ({"dtype": "bfloat16"}, None),
    "int8 (ours)": ({"quantization": "int8"}, None),
    "int8 (aten._weight_int8pack_mm)": ({"quantization": "int8"}, "int8pack"),
    "int8 (widened per block + oneDNN)": ({"quantization": "int8"}, "widen"),
}
SLOW = ("int8pack",)  # fewer steps for these


PREFILL_TOKENS = 256


def prefill_flops(model: torch.nn.Module, config, tokens: int) -> float:
    """FLOPs of one prefill of `tokens` tokens: every linear's multiply-adds per token, and causal
    attention's QK^T and PV over tokens * (tokens + 1) / 2 pairs per layer."""
    from worker.models.linear import Linear

    linear = sum(2 * m.in_features * m.out_features for m in model.modules()
                 if isinstance(m, Linear) and m is not getattr(model, "draft_head", None))
    pairs = tokens * (tokens + 1) / 2
    attention = 4 * config.head_dim * config.num_attention_heads * pairs * config.num_hidden_layers
    return linear * tokens + attention


def weight_bytes(model: torch.nn.Module) -> int:
    from worker.models.linear import Linear

    total = 0
    for m in model.modules():
        if not isinstance(m, Linear) or m is getattr(model, "draft_head", None):
            continue
        if m.int8 is not None:
            total += m.int8.numel() + m.scale.numel() * m.scale.element_size()
        else:  # (a packed weight's plain copy may be freed: its dtype is the model's)
            total += m.in_features * m.out_features * m.weight.element_size()
    return total


def step_runner(llm):
    """A function of n: the median time of the engine's n decode steps after a 16-token prompt's
    prefill, one request (each EngineCore.step timed on its own; the first is the prefill)."""
    from engine import SamplingParams

    prompt = list(range(100, 116))
    core = llm.engine
    step, times = core.step, []

    def timed_step():
        start = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - start)
        return out

    core.step = timed_step

    def run(steps: int) -> float:
        times.clear()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1 + steps, ignore_eos=True))
        return statistics.median(times[1:])

    def prefill() -> float:
        times.clear()
        prompt_long = [100 + i % 1000 for i in range(PREFILL_TOKENS)]
        llm.generate([prompt_long], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        return times[0]

    run(4)  # warm-up
    run.prefill = prefill
    return run


def one_thread_count(model: str, threads: int, steps: int, reps: int, names: list[str]) -> list[dict]:
    """In a child process: every variant loaded side by side, their decode steps timed in turn, rep
    after rep (the box is shared: interleaving spreads a neighbour's load over all variants alike,
    and the fastest rep of each is the one least disturbed)."""
    from engine import LLM

    engines, best, nbytes, prefill, flops = {}, {}, {}, {}, {}
    for name in names:
        args, _ = VARIANTS[name]
        key = json.dumps(args, sort_keys=True)
        if key not in engines:
            engines[key] = LLM(model, max_model_len=PREFILL_TOKENS + 64, max_num_seqs=1, num_threads=threads,
                               speculative_method=None, enable_prefix_caching=False, **args)
            engines[key].timed = step_runner(engines[key])
    for _ in range(reps):
        for name in names:
            args, way = VARIANTS[name]
            llm = engines[json.dumps(args, sort_keys=True)]
            for m in llm.engine.runner.model.model.layers.modules():
                if getattr(m, "int8", None) is not None:
                    m.int8_way = way or "kernel"
            step = llm.timed(max(2, steps // 8) if way in SLOW else steps)
            best[name] = min(best.get(name, float("inf")), step)
            nbytes[name] = weight_bytes(llm.engine.runner.model)
            prefill[name] = min(prefill.get(name, float("inf")), llm.timed.prefill())
            flops[name] = prefill_flops(llm.engine.runner.model, llm.engine.model_config, PREFILL_TOKENS)
    load = os.getloadavg()[0]
    for llm in engines.values():
        llm.shutdown()
    return [{"variant": name, "threads": threads, "step_ms": best[name] * 1e3, "weight_mb": nbytes[name] / 1e6,
             "gb_per_s": nbytes[name] / best[name] / 1e9, "prefill_ms": prefill[name] * 1e3,
             "gflop_per_s": flops[name] / prefill[name] / 1e9, "load": load} for name in names]


def kernel_candidates(threads: int, layers: int = 8) -> list[dict]:
    """One batch-1 row through the linears of `layers` Qwen3-0.6B decoder layers (qkv, o, gate_up,
    down; ~125 MB of int8, out of cache as in a step), per way of multiplying by an int8 weight, and
    the fp32 and bf16 weights for scale. torchao's Int8WeightOnlyConfig where it is importable."""
    import torch.nn.functional as F

    from worker.models.linear import bf16_linear_available, linear_kernels_available, linear_widening, quantize_int8

    torch.set_num_threads(threads)
    linear_kernels_available(), bf16_linear_available()
    shapes = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)] * layers
    plain = [torch.randn(n, k) * 0.02 for n, k in shapes]
    quant = [quantize_int8(w) for w in plain]
    ways = {
        "int8: ours (linear_kernels.cpp)": (lambda x, i: torch.ops.pdserve_linear.linear_int8w(x, *quant[i], None), 1),
        "int8: aten._weight_int8pack_mm": (lambda x, i: torch.ops.aten._weight_int8pack_mm(x, *quant[i]), 1),
        "int8: widened per block + oneDNN": (lambda x, i: linear_widening(x, *quant[i], None), 1),
    }
    ao = torchao_linears(plain)
    if ao is not None:
        ways["int8: torchao Int8WeightOnly (eager)"] = (lambda x, i: ao[i](x), 1)
    halves = [w.to(torch.bfloat16) for w in plain]
    ways["bf16: ours (bf16_linear.cpp)"] = (lambda x, i: torch.ops.pdserve_bf16.linear_bf16w(x, halves[i], None), 2)
    ways["fp32: F.linear (MKL)"] = (lambda x, i: F.linear(x, plain[i]), 4)
    out = []
    with torch.inference_mode():
        for name, (fn, width) in ways.items():
            inputs = [torch.randn(1, k) for _, k in shapes]
            best = float("inf")
            for _ in range(2 if "torchao" in name or "int8pack" in name else 7):
                start = time.perf_counter()
                for i in range(len(shapes)):
                    fn(inputs[i], i)
                best = min(best, time.perf_counter() - start)
            nbytes = sum(n * k for n, k in shapes) * width
            out.append({"way": name, "threads": threads, "ms": best * 1e3, "gb_per_s": nbytes / best / 1e9})
    return out


def crossover(threads: int) -> list[dict]:
    """Where a narrow weight's kernel stops paying: ms per call of the int8 and bf16 kernels against
    linear_widening (the weight widened a block at a time, then oneDNN: Linear's path above
    NARROW_MAX_ROWS), by row count, on Qwen3-0.6B's gate_up and down shapes; fastest of 3."""
    from worker.models.linear import linear_widening, quantize_int8

    torch.set_num_threads(threads)
    out = []
    with torch.inference_mode():
        for n, k in ((6144, 1024), (1024, 3072)):
            w = torch.randn(n, k) * 0.02
            q, scale = quantize_int8(w)
            half = w.to(torch.bfloat16)
            ways = {"int8 kernel": lambda x, q=q, s=scale: torch.ops.pdserve_linear.linear_int8w(x, q, s, None),
                    "int8 widened": lambda x, q=q, s=scale: linear_widening(x, q, s, None),
                    "bf16 kernel": lambda x, h=half: torch.ops.pdserve_bf16.linear_bf16w(x, h, None),
                    "bf16 widened": lambda x, h=half: linear_widening(x, h, None, None)}
            for rows in (32, 64, 96, 128, 256, 512):
                x = torch.randn(rows, k)
                row = {"shape": f"{n}x{k}", "rows": rows, "threads": threads}
                for name, fn in ways.items():
                    fn(x)
                    best = float("inf")
                    for _ in range(3):
                        start = time.perf_counter()
                        fn(x)
                        best = min(best, time.perf_counter() - start)
                    row[name] = best * 1e3
                out.append(row)
    return out


def crossover_table(rows: list[dict]) -> str:
    names = ["int8 kernel", "int8 widened", "bf16 kernel", "bf16 widened"]
    lines = ["| shape (out x in) | rows | torch threads | " + " | ".join(f"{n} (ms)" for n in names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    lines += [f"| {r['shape']} | {r['rows']} | {r['threads']} | " + " | ".join(f"{r[n]:.2f}" for n in names) + " |"
              for r in rows]
    return "\n".join(lines)


def torchao_linears(weights: list[torch.Tensor]) -> list[torch.nn.Module] | None:
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        return None
    mods = []
    for w in weights:
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data = w.clone()
        quantize_(lin, Int8WeightOnlyConfig())
        mods.append(lin)
    return mods


def bandwidth(threads: int, mib: int = 512) -> dict:
    torch.set_num_threads(threads)
    src = torch.ones(mib * 2**18)  # fp32: mib MiB
    dst = torch.empty_like(src)
    copy_s = sum_s = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        copy_s = min(copy_s, time.perf_counter() - start)
        start = time.perf_counter()
        src.sum()
        sum_s = min(sum_s, time.perf_counter() - start)
    nbytes = src.numel() * 4
    return {"threads": threads, "copy_gb_per_s": 2 * nbytes / copy_s / 1e9, "read_gb_per_s": nbytes / sum_s / 1e9}


def gemm_peak(threads: int, n: int = 2048) -> float:
    """GFLOP/s of an fp32 n^3 GEMM, best of 5."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def kernel_table(rows: list[dict]) -> str:
    lines = ["| way (1 row, 8 layers' linears) | torch threads | ms | weight GB/s |", "|---|---|---|---|"]
    lines += [f"| {r['way']} | {r['threads']} | {r['ms']:.2f} | {r['gb_per_s']:.1f} |" for r in rows]
    return "\n".join(lines)


def table(rows: list[dict], probes: list[dict]) -> str:
    fp32 = {r["threads"]: r["step_ms"] for r in rows if r["variant"] == "fp32"}
    probe = {p["threads"]: p for p in probes}
    lines = ["| weights (kernel) | torch threads | decode step (ms) | vs fp32 | weight MB read | weight GB/s | "
             "of read GB/s | prefill step (ms) | GFLOP/s | of GEMM peak | box load (1 min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base, p = fp32.get(r["threads"]), probe[r["threads"]]
        ratio = f"{base / r['step_ms']:.2f}x" if base else "-"
        lines.append(f"| {r['variant']} | {r['threads']} | {r['step_ms']:.1f} | {ratio} | {r['weight_mb']:.0f} | "
                     f"{r['gb_per_s']:.1f} | {r['gb_per_s'] / p['read_gb_per_s']:.0%} | {r['prefill_ms']:.0f} | "
                     f"{r['gflop_per_s']:.0f} | {r['gflop_per_s'] / p['gemm_gflop_per_s']:.0%} | {r['load']:.1f} |")
    lines += ["", "| torch threads | copy GB/s (read + written) | sum GB/s (read) | fp32 GEMM GFLOP/s |",
              "|---|---|---|---|"]
    lines += [f"| {p['threads']} | {p['copy_gb_per_s']:.1f} | {p['read_gb_per_s']:.1f} | {p['gemm_gflop_per_s']:.0f} |"
              for p in probes]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--child", help=argparse.SUPPRESS)  # JSON: one thread count's variants, in this process
    ap.add_argument("--out", type=Path, help="also write the tables here")
    args = ap.parse_args()
    if args.child:
        job = json.loads(args.child)
        print(json.dumps(one_thread_count(args.model, job["threads"], args.steps, args.reps, job["variants"])))
        return
    rows = []
    for threads in args.threads:
        child = json.dumps({"threads": threads, "variants": args.variants})
        out = subprocess.run([sys.executable, __file__, args.model, "--child", child, "--steps", str(args.steps),
                              "--reps", str(args.reps)], check=True, capture_output=True, text=True, cwd=REPO)
        rows += json.loads(out.stdout.strip().splitlines()[-1])
        print(rows[-len(args.variants):], flush=True)
    kernels = [row for t in args.threads for row in kernel_candidates(t)]
    rows_cross = [row for t in args.threads for row in crossover(t)]
    probes = [bandwidth(t) | {"gemm_gflop_per_s": gemm_peak(t)} for t in args.threads]
    text = "\n\n".join([table(rows, probes), kernel_table(kernels),
                         crossover_table(rows_cross)])
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
