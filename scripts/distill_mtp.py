#!/usr/bin/env python
"""Distil the bundled model's MTP layer from its own target (the target is not touched).

`train_tiny_model.py` trains the MTP layer on the corpus's next-next tokens, so its draft
distribution q imitates the data. Speculative decoding accepts a draft by comparing q with the
*target's* distribution p at that position: a sampled draft is kept with probability
sum_x min(p(x), q(x)) = 1 - TV(p, q), a greedy one when argmax q == argmax p. This script
fine-tunes only the MTP layer to minimise KL(p || q) over the draft vocabulary the engine drafts
from (`draft_vocab.json`, q's support; p restricted to it and renormalised, the best q can do
there), at every position of both recursive depths the engine drafts with (K = 2), with the
engine's MTP attention window. The target (and the shared embedding / lm_head) is frozen, so
the target's outputs -- what pdserve must reproduce token for token -- stay byte-identical.

    .venv/bin/python scripts/distill_mtp.py [--model models/pdserve-tiny] [--steps 3000]

Rewrites the folder's `model.safetensors` with the MTP tensors replaced (the target's written back
as read), records the held-out KL, sampled-draft acceptance and greedy agreement before and after
as `distillation` in `training_summary.json`, and re-runs `train_tiny_model.py --report-only` so the
model card's evaluation describes the distilled layer. Deterministic for a given --seed, thread
count and torch build.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
LOG = logging.getLogger("distill_mtp")

_spec = importlib.util.spec_from_file_location("train_tiny_model", Path(__file__).with_name("train_tiny_model.py"))
ttm = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ttm  # (its dataclasses look their module up there)
_spec.loader.exec_module(ttm)


def batch_stats(model, mtp, batch: torch.Tensor, vocab: torch.Tensor, depth: int, window: int):
    """batch [B, T+1]. Per pass: (KL(p~ || q) mean, expected acceptance of a sampled draft
    sum min(p, q) over the draft vocabulary with p the full target softmax, greedy agreement
    argmax q == argmax p), over positions 0..T-2 of the pass (those with a target next)."""
    t = batch.shape[1] - 1
    with torch.no_grad():
        h = model.model(input_ids=batch[:, :t]).last_hidden_state
        full = model.lm_head(h).float()
        p_full = full.softmax(-1)
        teacher = full[..., vocab].log_softmax(-1)       # p restricted to q's support, renormalised
    head = model.lm_head.weight[vocab]
    outs = ttm.mtp_passes(mtp, model.model.embed_tokens, model.model.rotary_emb, h, batch[:, 1: t + 1], depth, window)
    stats = []
    for k, g in enumerate(outs, start=1):
        # Pass k at position j (from the true hidden state at j-k+1) drafts x_{j+2}: the target's
        # distribution there is its output at position j+1.
        logq = (g[:, k - 1: t - 1] @ head.T).float().log_softmax(-1)
        logp = teacher[:, k: t]
        kl = (logp.exp() * (logp - logq)).sum(-1).mean()
        with torch.no_grad():
            p = p_full[:, k: t][..., vocab]
            accept = torch.minimum(p, logq.exp()).sum(-1).mean()
            greedy = (vocab[logq.argmax(-1)] == full[:, k: t].argmax(-1)).float().mean()
        stats.append((kl, float(accept), float(greedy)))
    return stats


def evaluate(model, mtp, windows: torch.Tensor, vocab, depth: int, window: int, batch_size: int) -> dict:
    mtp.eval()
    tot = np.zeros((depth, 3))
    with torch.no_grad():
        for s in range(0, len(windows), batch_size):
            for k, (kl, acc, greedy) in enumerate(batch_stats(model, mtp, windows[s: s + batch_size], vocab,
                                                              depth, window)):
                tot[k] += np.array([float(kl), acc, greedy]) * len(windows[s: s + batch_size])
    mtp.train()
    tot /= len(windows)
    return {"kl": tot[:, 0].round(4).tolist(), "sampled_acceptance": tot[:, 1].round(4).tolist(),
            "greedy_agreement": tot[:, 2].round(4).tolist()}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO_ROOT / "models" / "pdserve-tiny"))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--depth", type=int, default=2, help="recursive passes trained (the engine's K)")
    ap.add_argument("--depth-decay", type=float, default=0.5, help="loss weight factor per extra pass")
    ap.add_argument("--window", type=int, default=32, help="the engine's MTP attention window (0: none)")
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    folder = Path(args.model)
    summary = json.loads((folder / "training_summary.json").read_text())
    heldout_permille = summary["args"]["heldout_permille"]

    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eot = tok.token_to_id(ttm.EOT)
    docs = ttm.collect_corpus()
    train_docs = [d for d in docs if not ttm.is_heldout(d.relpath, heldout_permille)]
    held_docs = [d for d in docs if ttm.is_heldout(d.relpath, heldout_permille)]
    data = torch.from_numpy(ttm.encode_stream(tok, [d.text for d in train_docs], eot).astype(np.int64))
    heldout = ttm.encode_stream(tok, [d.text for d in held_docs], eot)
    windows = ttm.heldout_windows(heldout, args.seq_len - 1, args.eval_windows)  # [n, seq_len + 1]
    LOG.info("train %d tokens, held-out %d windows", len(data), len(windows))

    logging.getLogger("transformers").setLevel(logging.ERROR)  # the (intended) unused MTP keys
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    mtp = ttm.load_mtp(folder, model.config).train()
    vocab = torch.tensor(json.loads((folder / "draft_vocab.json").read_text())["token_ids"], dtype=torch.long)
    before = evaluate(model, mtp, windows, vocab, args.depth, args.window, args.batch_size)
    LOG.info("before: %s", before)

    params = list(mtp.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    weights = [args.depth_decay ** k for k in range(args.depth)]
    gen = torch.Generator().manual_seed(args.seed + 3)
    warmup = max(10, args.steps // 20)
    t0 = time.time()
    bar = tqdm(range(args.steps), desc="distil", mininterval=5.0)
    for step in bar:
        lr = args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([data[s: s + args.seq_len + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            stats = batch_stats(model, mtp, batch, vocab, args.depth, args.window)
        loss = sum(w * kl for w, (kl, _, _) in zip(weights, stats))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        bar.set_postfix(kl=f"{float(stats[0][0].detach()):.3f}", acc=f"{stats[0][1]:.3f}")
    seconds = time.time() - t0
    mtp.eval()
    after = evaluate(model, mtp, windows, vocab, args.depth, args.window, args.batch_size)
    LOG.info("after (%.0f s): %s", seconds, after)

    # The target's tensors are written back as read; only the MTP layer's change.
    state = load_file(str(folder / "model.safetensors"))
    new = {name: t for name, t in state.items() if not name.startswith(ttm.MTP_PREFIX)}
    for name, t in mtp.state_dict().items():
        new[ttm.MTP_PREFIX + name] = t.detach().to(torch.bfloat16).contiguous()
    if new.keys() != state.keys():
        raise SystemExit("the MTP layer's tensor names differ from the checkpoint's")
    save_file(dict(sorted(new.items())), str(folder / "model.safetensors"), metadata={"format": "pt"})
    summary["distillation"] = {
        "command": " ".join(["scripts/distill_mtp.py"] + [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                                         if k != "model" and v != ap.get_default(k)]),
        "seconds": round(seconds, 1),
        "heldout_windows": len(windows),
        "before": before,
        "after": after,
    }
    (folder / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    # The model card's evaluation (greedy acceptance, self-check) re-run on the distilled layer.
    ttm.main(["--report-only", "--out", str(folder)])


if __name__ == "__main__":
    main()
