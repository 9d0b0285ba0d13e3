"""Greedy exactness at real size: pdserve on a 0.5B-class checkpoint in fp32, bf16 and int8 weights
against transformers fp32 on the same weights (bf16-rounded, or int8 dequantized), token by token.

The tests check the same contract on small random checkpoints of every architecture; this runs it
at the size users serve, on any device (scripts/gpu_check.sh runs it on CUDA). Per weights and
prompt it prints how many tokens matched and, at a first difference, the reference's top-2 logit
gap there (a float-noise tie is below 1e-4). On CUDA, bf16 means bf16 arithmetic too, so the bf16
rows there measure agreement rather than exactness.

    python scripts/make_random_checkpoint.py /tmp/q06 --preset qwen3-0.6b
    python benchmarks/check_realsize.py /tmp/q06 [--device cuda] [--new-tokens 32]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine import LLM, SamplingParams  # noqa: E402
from worker.models.linear import dequantize_int8, quantize_int8  # noqa: E402

WEIGHTS = {"fp32": {}, "bf16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}}
TIE = 1e-4


def reference(model_dir: str, weights: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        if weights == "bf16":
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16))
        if weights == "int8":  # the decoder layers' linears, as --quantization int8 stores them
            for m in model.model.layers.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.copy_(dequantize_int8(*quantize_int8(m.weight)))
    return model


def compare(model, prompt: list[int], ours: list[int]) -> dict:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=len(ours), min_new_tokens=len(ours),
                             do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    ref = out.sequences[0, len(prompt):].tolist()
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = out.logits[i][0].float().topk(2).values
            gap = float(top2[0] - top2[1])
            return {"matched": i, "of": len(ref), "gap_at_difference": gap, "tie": gap < TIE}
    return {"matched": len(ref), "of": len(ref)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--weights", nargs="+", default=list(WEIGHTS))
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 4000, (n,), generator=gen).tolist() for n in (16, 64, 200)[: args.prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    for weights in args.weights:
        llm = LLM(args.model, device=args.device, max_model_len=512, speculative_method=None, **WEIGHTS[weights])
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
        model = reference(args.model, weights)
        for prompt, ours in zip(prompts, outs):
            row = {"weights": weights, "device": args.device, "prompt_tokens": len(prompt)}
            print(json.dumps(row | compare(model, prompt, ours)), flush=True)
        del model


if __name__ == "__main__":
    main()
