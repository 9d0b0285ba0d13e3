"""Helpers shared by the benchmarks: model choice, prompts, percentiles, a tokenizer for
tokenizer-less checkpoints."""
from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.config import DEFAULT_MODEL_DIR
from engine.tokenizer import has_tokenizer

# Said in a report when `resolve_model` fell back to a random-weight checkpoint.
RANDOM_MODEL_NOTE = " (random weights: the bundled model was not available)"


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


def ensure_tokenizer(model_dir: str) -> str:
    """Give a tokenizer-less checkpoint (a random-weight one) a byte-level BPE tokenizer of exactly its
    vocabulary size, trained here on this Python's standard library sources (printable ASCII only).

    The server streams text, and a checkpoint without a tokenizer streams no text at all, so its chunks
    could not be timed the way `pdserve bench` (and vLLM's bench) time them. ASCII-only tokens never
    end inside a UTF-8 character, so every generated token shows up in the stream as soon as it is
    made. Byte-level BPE (vocab + merges, no special tokens) is also what transformers' Qwen2/Llama
    tokenizer classes rebuild from `tokenizer.json`, so `AutoTokenizer` loads it for any architecture."""
    path = Path(model_dir)
    if has_tokenizer(path):
        return model_dir
    import json
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for f in sorted(stdlib.glob("*.py"))[:200]:
        lines = f.read_text(errors="replace").splitlines()
        texts.append("\n".join(ln for ln in lines if ln.isascii() and (ln.isprintable() or not ln)))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    if tok.get_vocab_size() < vocab_size:  # a tiny corpus: fill the rest with plain ASCII words
        tok.add_tokens([f"w{i}" for i in range(vocab_size - tok.get_vocab_size())])
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return model_dir


def median_seconds(fn, reps: int) -> float:
    """The median wall time of `reps` calls of fn, after one untimed call (builds, caches)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
