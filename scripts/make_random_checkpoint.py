"""Write a random-weight Hugging Face checkpoint of a real model's shapes, with the bundled tokenizer.

For speed and liveness work at real size without downloading anything: the weights are random
(speed and step times do not depend on them), the shapes are the real model's, the vocabulary is
the bundled tokenizer's (so prompts, the API and transformers' reference all work as they do on
the bundled model). `--mtp` adds one random MTP layer, so that `make serve`'s default (PD + MTP)
runs on it as it would on a checkpoint that ships one (its drafts are accepted only by chance).

    python scripts/make_random_checkpoint.py OUT_DIR [--preset qwen3-0.6b] [--mtp] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "models" / "pdserve-tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# The body of each preset (transformers config fields); the vocabulary is the bundled tokenizer's.
PRESETS: dict[str, dict] = {
    # Qwen3-0.6B: 28 layers, hidden 1024, 16 query / 8 KV heads of 128, MLP 3072, tied embeddings.
    "qwen3-0.6b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, tie_word_embeddings=True, attention_bias=False),
    # A 2-layer Qwen3 of the same widths, for tests of the script itself.
    "qwen3-test": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=128,
                       intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, tie_word_embeddings=True, attention_bias=False),
}


def layer_shapes(cfg: dict, prefix: str) -> dict[str, tuple[int, ...]]:
    """Every tensor of one Qwen3 decoder layer under `prefix`, with its shape."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {f"{prefix}self_attn.q_proj.weight": (q, h), f"{prefix}self_attn.k_proj.weight": (kv, h),
            f"{prefix}self_attn.v_proj.weight": (kv, h), f"{prefix}self_attn.o_proj.weight": (h, q),
            f"{prefix}self_attn.q_norm.weight": (d,), f"{prefix}self_attn.k_norm.weight": (d,),
            f"{prefix}mlp.gate_proj.weight": (inter, h), f"{prefix}mlp.up_proj.weight": (inter, h),
            f"{prefix}mlp.down_proj.weight": (h, inter),
            f"{prefix}input_layernorm.weight": (h,), f"{prefix}post_attention_layernorm.weight": (h,)}


def checkpoint_shapes(cfg: dict, mtp: bool) -> dict[str, tuple[int, ...]]:
    h = cfg["hidden_size"]
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        shapes.update(layer_shapes(cfg, f"model.layers.{i}."))
    if mtp:  # the layout worker/models/mtp.py loads (a decoder layer plus the MTP fusion)
        p = "model.mtp_layers.0."
        shapes.update(layer_shapes(cfg, p))
        shapes.update({f"{p}input_proj.weight": (h, 2 * h), f"{p}hidden_layernorm.weight": (h,),
                       f"{p}token_layernorm.weight": (h,), f"{p}final_layernorm.weight": (h,)})
    return shapes


def checkpoint_config(preset: str = "qwen3-0.6b", mtp: bool = False) -> dict:
    """config.json of a checkpoint of `preset`, with the bundled tokenizer's vocabulary and special tokens
    (a function of its own so that tests can check a preset's shapes without writing its weights)."""
    bundled = json.loads((BUNDLED / "config.json").read_text())
    cfg = {**PRESETS[preset], "vocab_size": bundled["vocab_size"], "bos_token_id": bundled["bos_token_id"],
           "eos_token_id": bundled["eos_token_id"], "pad_token_id": bundled.get("pad_token_id"),
           "hidden_act": "silu", "torch_dtype": "float32", "use_cache": True}
    if mtp:
        cfg["num_nextn_predict_layers"] = 1
    return cfg


def write_checkpoint(out: Path, preset: str = "qwen3-0.6b", mtp: bool = False, seed: int = 0) -> Path:
    """The checkpoint in `out` (created): config.json, model.safetensors (fp32), the bundled tokenizer."""
    cfg = checkpoint_config(preset, mtp)
    gen = torch.Generator().manual_seed(seed)
    std = 0.02  # transformers' initializer_range for Qwen3
    tensors = {}
    for name, shape in checkpoint_shapes(cfg, mtp).items():
        if len(shape) == 1:  # norms: ones, as a fresh model has them
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=gen) * std
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg["eos_token_id"]}) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(BUNDLED / name, out / name)
    n = sum(t.numel() for t in tensors.values())
    logging.info("wrote %s: %s, %.3fB parameters (fp32, %.2f GB)%s", out, preset, n / 1e9, n * 4 / 1e9,
                 ", with a random MTP layer" if mtp else "")
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-0.6b")
    ap.add_argument("--mtp", action="store_true", help="add one random MTP layer (num_nextn_predict_layers=1)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    write_checkpoint(args.out, args.preset, args.mtp, args.seed)


if __name__ == "__main__":
    main()
