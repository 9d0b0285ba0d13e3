"""Compatibility hash: two instances may exchange KV only if their caches mean the same thing.

The description covers three things, each of which changes what a KV block means:
  kv       the cache layout (dtype, block size, layers incl. MTP, heads, head size)
  config   the model-affecting fields of config.json (architecture, sizes, rope, norms, dtype, MTP)
  weights  a fingerprint of every tensor: name, shape, dtype and a sample of its bytes spread
           over the whole tensor (read from the safetensors files without loading them), so a
           fine-tune that leaves the first MiB of a file alone is still told apart.
Both sides send the description itself in the handshake, so a refusal names what differs.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import xxhash

from engine.config import EngineConfig, ModelConfig

# config.json fields that change the model's activations (so its KV). Missing ones count as None.
CONFIG_FIELDS = (
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "layer_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "max_position_embeddings",
    "attention_bias", "mlp_bias", "tie_word_embeddings", "sliding_window", "use_sliding_window",
    "max_window_layers", "layer_types", "torch_dtype", "dtype", "num_nextn_predict_layers",
)
SAMPLES_PER_TENSOR = 64   # evenly spread windows of each tensor's bytes
SAMPLE_BYTES = 64
MAX_NAMED_DIFFERENCES = 6


def _sampled(f, start: int, end: int) -> bytes:
    """The whole tensor when small, else SAMPLES_PER_TENSOR windows spread from its first byte to its last."""
    size = end - start
    if size <= SAMPLES_PER_TENSOR * SAMPLE_BYTES:
        f.seek(start)
        return f.read(size)
    step = (size - SAMPLE_BYTES) / (SAMPLES_PER_TENSOR - 1)
    out = bytearray()
    for i in range(SAMPLES_PER_TENSOR):
        f.seek(start + int(i * step))
        out += f.read(SAMPLE_BYTES)
    return bytes(out)


def tensor_fingerprints(model_dir: str | Path) -> dict[str, str]:
    """{tensor name: hash of its dtype, shape and sampled bytes} over every *.safetensors file."""
    out: dict[str, str] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            base = 8 + header_len
            for name, info in sorted(header.items()):
                if name == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                h = xxhash.xxh3_64(f"{info['dtype']}{info['shape']}".encode())
                h.update(_sampled(f, base + begin, base + end))
                out[name] = h.hexdigest()
    return out


def compat_description(config: EngineConfig, model_cfg: ModelConfig, num_kv_layers: int) -> dict:
    raw = model_cfg.raw
    return {
        # The weights' quantization is no part of the cache layout, but P and D must run the same model.
        "kv": {"dtype": config.dtype, "quantization": config.quantization or "none",
               "block_size": config.block_size, "kv_layers": num_kv_layers,
               "kv_heads": model_cfg.num_key_value_heads, "head_dim": model_cfg.head_dim},
        "config": {"vocab_size": model_cfg.vocab_size, **{k: raw.get(k) for k in CONFIG_FIELDS},
                   "normalized_rope": [model_cfg.rope_theta, model_cfg.rope_scaling]},
        "weights": tensor_fingerprints(config.model),
    }


def compat_hash(description: dict) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


def describe_difference(mine: dict[str, Any], theirs_json: str, here: str = "prefill", there: str = "decode") -> str:
    """What differs between this side's description and a peer's (as sent in its Hello), in words."""
    try:
        theirs = json.loads(theirs_json)
        assert isinstance(theirs, dict)
    except (ValueError, AssertionError):
        return "their layout (the peer sent no readable description)"
    diffs: list[str] = []
    for section in ("kv", "config"):
        a, b = mine.get(section) or {}, theirs.get(section) or {}
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                diffs.append(f"{section}.{key} ({a.get(key)!r} on {here}, {b.get(key)!r} on {there})")
    a, b = mine.get("weights") or {}, theirs.get("weights") or {}
    for name in sorted(set(a) | set(b)):
        if name not in b or name not in a:
            diffs.append(f"weights: tensor {name} only on {here if name in a else there}")
        elif a[name] != b[name]:
            diffs.append(f"weights of tensor {name}")
    more = len(diffs) - MAX_NAMED_DIFFERENCES
    named = "; ".join(diffs[:MAX_NAMED_DIFFERENCES])
    return f"{named}; and {more} more" if more > 0 else (named or "their layout")
