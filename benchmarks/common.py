"""Helpers shared by the benchmarks: model choice, prompts, timing, percentile formatting."""
from __future__ import annotations

import random
import tempfile
from pathlib import Path

import numpy as np

from engine.config import DEFAULT_MODEL_DIR


def resolve_model(model: str | None, random_config: dict | None = None) -> str:
    """The given checkpoint, else the bundled model, else a random-weight Qwen2 written for the run."""
    if model:
        return model
    if (DEFAULT_MODEL_DIR / "config.json").is_file():
        return str(DEFAULT_MODEL_DIR)
    import torch
    import transformers

    cfg = transformers.Qwen2Config(**(random_config or dict(vocab_size=4096, hidden_size=256, intermediate_size=704,
                                                          num_hidden_layers=4, num_attention_heads=4,
                                                          num_key_value_heads=2, max_position_embeddings=2048)))
    torch.manual_seed(0)
    path = Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


def mixed_prompts(n: int, vocab: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")
