"""Compatibility hash: two instances may exchange KV only if their caches mean the same thing."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from engine.config import EngineConfig, ModelConfig


def weights_fingerprint(model_dir: str | Path) -> str:
    """Cheap identity of the weights: file names, sizes and the first MiB of each file."""
    h = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(path.name.encode())
        h.update(str(path.stat().st_size).encode())
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def compat_description(config: EngineConfig, model_cfg: ModelConfig, num_kv_layers: int) -> dict:
    return {
        "model_type": model_cfg.model_type,
        "weights": weights_fingerprint(config.model),
        "dtype": config.dtype,
        "block_size": config.block_size,
        "kv_layers": num_kv_layers,
        "kv_heads": model_cfg.num_key_value_heads,
        "head_dim": model_cfg.head_dim,
    }


def compat_hash(description: dict) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
