"""Write a checkpoint's draft vocabulary: the tokens its training corpus uses most (FR-Spec).

MTP drafts over these tokens only (`--draft-vocab auto` reads `draft_vocab.json` from the
checkpoint folder, worker/model_loader.py), which makes a draft's lm_head `--size / vocab` as
large. For the bundled model the corpus is the one scripts/train_tiny_model.py trained it on (the
running Python's standard library, the held-out files excluded), so nothing is downloaded. The
file records how much of that text the chosen tokens cover.

    python scripts/make_draft_vocab.py [--model models/pdserve-tiny] [--size 1024]
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.train_tiny_model import collect_corpus, is_heldout  # noqa: E402
from worker.model_loader import DRAFT_VOCAB_FILE  # noqa: E402

LOG = logging.getLogger("make_draft_vocab")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "models" / "pdserve-tiny"))
    ap.add_argument("--size", type=int, default=1024, help="tokens in the draft vocabulary")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    model = Path(args.model)
    summary = json.loads((model / "training_summary.json").read_text())
    heldout = summary["args"]["heldout_permille"]
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    texts = [d.text for d in collect_corpus() if not is_heldout(d.relpath, heldout)]
    counts = np.zeros(vocab, dtype=np.int64)
    for enc in tok.encode_batch(texts):
        counts += np.bincount(np.asarray(enc.ids, dtype=np.int64), minlength=vocab)
    order = np.argsort(-counts, kind="stable")[: args.size]
    coverage = float(counts[order].sum() / counts.sum())
    out = {"token_ids": sorted(int(i) for i in order), "coverage": round(coverage, 4),
           "source": f"scripts/make_draft_vocab.py --size {args.size}: the {args.size} most frequent of {vocab} "
                     f"tokens in the training corpus ({len(texts)} files, {int(counts.sum())} tokens)"}
    (model / DRAFT_VOCAB_FILE).write_text(json.dumps(out) + "\n")
    LOG.info("%s: %d of %d tokens, covering %.1f%% of the corpus", model / DRAFT_VOCAB_FILE, args.size, vocab,
             100 * coverage)


if __name__ == "__main__":
    main()
