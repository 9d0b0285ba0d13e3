"""Per-token cost of a grammar token mask on this CPU: xgrammar against llguidance.

For each engine, one JSON schema (and the free JSON-object grammar) is compiled once, then a
matcher walks a random path through the grammar: at every step it fills the next-token bitmask,
the bitmask is applied to a logits row, a random allowed token is accepted. Reported: compile
time, and the median / p99 time per token of fill, apply and accept, on the tokenizer's vocabulary
(the bundled model's by default; --model takes any local HF checkpoint directory). llguidance is
optional (`pip install llguidance`); without it only xgrammar is measured.

Then the engine's own path (worker/structured.py, what the runner pays per step): masks for a batch
of B constrained rows (fill + unpack) and the sampler's masked_fill, for a few batch sizes.

Last, MTP speculation under the schema (offline LLM, greedy, fixed K=3): draft acceptance and
tokens/s with drafts picked under the grammar (the engine's default) and with unconstrained drafts.

    .venv/bin/python benchmarks/bench_grammar_mask.py [--model DIR] [--tokens 300]
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

logger = logging.getLogger("bench_grammar_mask")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "colour", "tags", "ok"],
    "additionalProperties": False,
}


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray) -> None:
    """The engine's own apply (worker/structured.py does the same): unpack bits, -inf the rest."""
    allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: logits.shape[-1]]
    logits.masked_fill_(torch.from_numpy(allowed) == 0, float("-inf"))


def pick(logits: torch.Tensor, rng: np.random.Generator) -> int:
    allowed = torch.nonzero(torch.isfinite(logits)).flatten().tolist()
    return int(allowed[rng.integers(len(allowed))])


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab = vocab_size

    def compile(self, schema: str | None):
        return (self.compiler.compile_builtin_json_grammar() if schema is None
                else self.compiler.compile_json_schema(schema, strict_mode=True))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(1, self.vocab)

    def fill(self, m, bitmask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(bitmask, 0)

    def accept(self, m, token: int) -> None:
        assert m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab = vocab_size

    def compile(self, schema: str | None):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}, defaults={"whitespace_flexible": False})
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tok, compiled)

    def bitmask(self) -> torch.Tensor:
        return torch.full((1, (self.vocab + 31) // 32), -1, dtype=torch.int32)

    def fill(self, m, bitmask: torch.Tensor) -> None:
        import llguidance.torch
        llguidance.torch.fill_next_token_bitmask(m, bitmask, 0)

    def accept(self, m, token: int) -> None:
        assert m.consume_token(token), m.get_error()

    def done(self, m) -> bool:
        return m.is_stopped()


def walk(engine, schema: str | None, num_tokens: int, vocab: int, eos: int, seed: int) -> dict[str, list[float]]:
    # Compile plus the first matcher: llguidance compiles lazily, when a matcher is made.
    t0 = time.perf_counter()
    compiled = engine.compile(schema)
    m = engine.matcher(compiled)
    times: dict[str, list[float]] = {"compile": [time.perf_counter() - t0], "fill": [], "apply": [], "accept": []}
    rng = np.random.default_rng(seed)
    bitmask = engine.bitmask()
    for _ in range(num_tokens):
        if engine.done(m):
            m = engine.matcher(compiled)
        a = time.perf_counter()
        engine.fill(m, bitmask)
        b = time.perf_counter()
        logits = torch.zeros(vocab)
        apply_bitmask(logits, bitmask.numpy()[0])
        c = time.perf_counter()
        # EOS only when nothing else is allowed: keeps the walk inside the grammar for longer.
        finite = torch.isfinite(logits)
        if finite.sum() > 1:
            logits[eos] = float("-inf")
        token = pick(logits, rng)
        d = time.perf_counter()
        engine.accept(m, token)
        e = time.perf_counter()
        times["fill"].append(b - a)
        times["apply"].append(c - b)
        times["accept"].append(e - d)
    return times


def engine_path(model: str, vocab: int, eos: list[int], rounds: int = 200) -> None:
    from engine.types import GrammarKind, GrammarSpec
    from worker.sample.sampler import Sampler, SamplingMetadata
    from worker.structured import GrammarCompiler, GrammarStates

    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    sampler = Sampler(seed=0)
    logger.info("%-8s %14s %14s", "batch", "masks us/step", "apply us/step")
    for batch in (1, 8, 32):
        states = GrammarStates(batch, GrammarCompiler(model, vocab, eos))
        for slot in range(batch):
            states.admit(slot, spec, [])
        meta = SamplingMetadata.from_lists([0.0] * batch)
        logits = torch.randn(batch, vocab)
        fill, apply = [], []
        for _ in range(rounds):
            a = time.perf_counter()
            meta.allowed_token_mask = states.position_masks(list(range(batch)), [[]] * batch)
            b = time.perf_counter()
            sampler.apply_penalties_and_bans(logits, meta)
            fill.append(b - a)
            apply.append(time.perf_counter() - b)
        logger.info("%-8d %14.1f %14.1f", batch, us(fill, 0.5), us(apply, 0.5))


def mtp_acceptance(model: str, num_prompts: int = 8) -> None:
    from engine import LLM, SamplingParams
    from engine.types import GrammarKind, GrammarSpec

    params = SamplingParams(max_tokens=160, temperature=0.0,
                            grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    prompts = [f"Record {i}:" for i in range(num_prompts)]
    logger.info("%-22s %10s %8s", "MTP drafts", "accepted", "tok/s")
    for label, guided in (("under the grammar", True), ("unconstrained", False)):
        llm = LLM(model, max_num_seqs=num_prompts, speculative_method="mtp", num_speculative_tokens=3,
                  spec_policy="fixed")
        if not guided:
            llm.engine.runner.drafter.grammar = None
        llm.generate(prompts[:1], params)  # warm-up
        stats = llm.engine.scheduler.spec_stats
        accepted0, drafted0 = stats.num_accepted_tokens, stats.num_draft_tokens
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        rate = (stats.num_accepted_tokens - accepted0) / max(1, stats.num_draft_tokens - drafted0)
        logger.info("%-22s %10.2f %8.0f", label, rate, sum(len(o.token_ids) for o in outs) / elapsed)
        llm.shutdown()


def us(xs: list[float], q: float) -> float:
    return 1e6 * (statistics.median(xs) if q == 0.5 else sorted(xs)[min(len(xs) - 1, int(q * len(xs)))])


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "models" / "pdserve-tiny"))
    parser.add_argument("--tokens", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    eos = tokenizer.eos_token_id
    logger.info("model %s, vocab %d, %d tokens per walk, 1 thread", args.model, vocab, args.tokens)
    logger.info("%-11s %-12s %10s %11s %11s %11s %11s", "engine", "grammar", "compile ms", "fill p50 us",
                "fill p99 us", "apply p50", "accept p50")
    for cls in (XGrammar, LLGuidance):
        try:
            engine = cls(tokenizer, vocab)
        except ImportError:
            logger.info("%-11s not installed: skipped", cls.name)
            continue
        for label, schema in (("json_object", None), ("json_schema", json.dumps(SCHEMA))):
            first = walk(engine, schema, 20, vocab, eos, 1)  # cold: its compile time is the one reported
            t = walk(engine, schema, args.tokens, vocab, eos, 0)
            logger.info("%-11s %-12s %10.1f %11.1f %11.1f %11.1f %11.1f", engine.name, label, 1e3 * first["compile"][0],
                        us(t["fill"], 0.5), us(t["fill"], 0.99), us(t["apply"], 0.5), us(t["accept"], 0.5))
    logger.info("engine path (xgrammar, json_schema, first position of each row), median of 200 steps:")
    engine_path(args.model, vocab, [eos])
    if (Path(args.model) / "config.json").read_text().find("num_nextn_predict_layers") >= 0:
        mtp_acceptance(args.model)


if __name__ == "__main__":
    main()
