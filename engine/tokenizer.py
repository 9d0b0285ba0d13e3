"""Loading a checkpoint's tokenizer: shared by the offline API and the HTTP front end, without
pulling in the engine (torch, the model) on the front end's side."""
from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizer, or None when the directory has none (test checkpoints)."""
    if not has_tokenizer(model_dir):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))
