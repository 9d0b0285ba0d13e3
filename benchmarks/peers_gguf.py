"""Run llama.cpp's convert_hf_to_gguf.py, with a named fallback for an unrecognised BPE pre-tokenizer.

    GGUF_VENV_PYTHON benchmarks/peers_gguf.py [--pre-tokenizer NAME] SRC/convert_hf_to_gguf.py MODEL ARGS...

Run in the converter's venv (scripts/install_llama_cpp.sh), never by pdserve's Python. The converter
names a BPE tokenizer's pre-tokenizer (the regex that splits text before BPE, written to the GGUF as
`tokenizer.ggml.pre`) by hashing how the tokenizer encodes a test string and looking the hash up among
known models. The hash depends on the vocabulary as well as the regex, so the bundled tokenizer (our own
4096-token BPE, with Qwen2's regex) and the random checkpoints that copy it are never found, and the
converter stops. With `--pre-tokenizer qwen2` this wrapper answers NAME for exactly that case, and only
after checking that tokenizer.json's split regex is the one llama.cpp implements under NAME; every
recognised tokenizer keeps the converter's own answer. Everything else is the converter unchanged.
"""
from __future__ import annotations

import json
import logging
import runpy
import sys
from pathlib import Path

logger = logging.getLogger("peers_gguf")

# The split regexes of the pre-tokenizers this wrapper may name (as in the models' tokenizer.json).
KNOWN_REGEX = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def split_regexes(model: Path) -> list[str]:
    pre = json.loads((model / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre])
    return [p["pattern"]["Regex"] for p in parts if p.get("type") == "Split" and "Regex" in p.get("pattern", {})]


def patch_fallback(name: str, model: Path) -> None:
    """Make the converter answer `name` where it would raise for an unknown pre-tokenizer hash."""
    if split_regexes(model) != [KNOWN_REGEX[name]]:
        raise SystemExit(f"{model}/tokenizer.json does not split text with {name}'s regex: no fallback")
    from conversion.base import TextModel  # the converter's package, importable from its directory

    original = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            logger.warning("pre-tokenizer hash not among llama.cpp's known models; the regex is %s's: using it", name)
            return name

    TextModel.get_vocab_base_pre = get_vocab_base_pre


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    argv = sys.argv[1:]
    name = None
    if argv[:1] == ["--pre-tokenizer"]:
        name, argv = argv[1], argv[2:]
    script = Path(argv[0])
    sys.path.insert(0, str(script.parent))  # as running the script directly would
    if name:
        patch_fallback(name, Path(argv[1]))
    sys.argv = [str(script), *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
