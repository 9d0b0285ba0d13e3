"""Offline throughput: pdserve `LLM.generate` vs transformers `generate` (batched, left-padded),
on the same prompts of mixed lengths, measured side by side in one run.

    python benchmarks/bench_offline.py [--model DIR] [--device cpu|cuda] [--num-prompts 64]
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import mixed_prompts, resolve_model  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def run_transformers(model_dir: str, prompts: list[list[int]], new_tokens: int, device: str, dtype: torch.dtype,
                     batch_size: int) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=pad, eos_token_id=None)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_pdserve(model_dir: str, prompts: list[list[int]], new_tokens: int, device: str, dtype: str) -> float:
    llm = LLM(model_dir, device=device, dtype=dtype, max_num_seqs=len(prompts), max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == new_tokens for o in outs)
    llm.shutdown()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    from engine.config import ModelConfig

    vocab = ModelConfig.from_dir(model).vocab_size
    prompts = mixed_prompts(args.num_prompts, vocab, args.min_len, args.max_len)
    total_out = args.num_prompts * args.new_tokens
    t_pd = run_pdserve(model, prompts, args.new_tokens, args.device, args.dtype)
    t_hf = run_transformers(model, prompts, args.new_tokens, args.device, getattr(torch, args.dtype),
                            args.hf_batch_size)
    print(f"model: {model} | device: {args.device} {args.dtype} | threads: {torch.get_num_threads()}")
    print(f"{args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens, {args.new_tokens} new tokens each "
          f"(greedy, EOS ignored); transformers batch size {args.hf_batch_size}, left-padded")
    print(f"{'engine':<14}{'seconds':>10}{'output tok/s':>15}")
    print(f"{'pdserve':<14}{t_pd:>10.2f}{total_out / t_pd:>15.1f}")
    print(f"{'transformers':<14}{t_hf:>10.2f}{total_out / t_hf:>15.1f}")
    print(f"ratio pdserve / transformers: {t_hf / t_pd:.2f}x")


if __name__ == "__main__":
    main()
