"""Structured output: per-slot grammar matchers (xgrammar) and the token masks they give the sampler.

Why xgrammar: benchmarks/bench_grammar_mask.py measures the per-token mask on this CPU (bundled
vocabulary, 1 thread): filling the bitmask of a JSON-schema matcher costs xgrammar several times
less than llguidance, at the median and at p99, with the same apply cost
(benchmarks/results/grammar_mask.txt); it also rolls back natively, which speculative decoding needs.

A request with `SamplingParams.grammar` owns a matcher in its slot. The matcher has consumed
exactly the request's output tokens so far: on admission it is rebuilt from the outputs the
request arrives with (a PD handoff brings t0, a resumed request its earlier outputs), so a decode
instance continues where the prefill instance stopped. Each verify window is masked position by
position: position j gets the mask of the state after drafts[:j], the drafts are walked into the
matcher to get there, and the walk is rolled back before the tokens actually kept are accepted.
A draft the grammar refuses makes every later position of its window moot (the target cannot
sample it, so verification stops there): those positions are left unmasked. The drafters follow
the grammar too (DraftWalk for MTP, `valid_prefix` for n-gram lookup), which only changes which
drafts are proposed, never the output: on the bundled model it lifts MTP acceptance under a JSON
schema several-fold (benchmarks/results/grammar_mask.txt).

Compiled grammars are cached by spec (kind + text), so a schema is compiled once per process.
Compiling never happens inside an engine step: an engine process compiles a request's grammar on
a thread of its own before the request reaches the scheduler (engine/grammar_prep.py), and the
request carries the compiled grammar to its slot. The front end compiles the same spec first, in
worker processes with a time and size budget (server/grammar_pool.py), and refuses with a 400 what
fails or runs over.
"""
from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import xgrammar as xgr

from engine.types import GrammarKind, GrammarSpec

logger = logging.getLogger(__name__)

# Compact separators and no free whitespace: a model that keeps emitting spaces could otherwise
# never finish a bounded schema, and the output is byte-for-byte what json.dumps would write.
_JSON_OPTIONS = dict(any_whitespace=False, strict_mode=True)
_CACHE_SIZE = 256


def build_grammar(spec: GrammarSpec) -> xgr.Grammar:
    """The grammar of a spec, without a tokenizer. Raises ValueError naming what is wrong."""
    try:
        if spec.kind == GrammarKind.JSON_OBJECT:
            return xgr.Grammar.from_json_schema('{"type": "object"}', **_JSON_OPTIONS)
        if spec.kind == GrammarKind.JSON_SCHEMA:
            return xgr.Grammar.from_json_schema(spec.text, **_JSON_OPTIONS)
        return xgr.Grammar.from_structural_tag(spec.text)
    except (RuntimeError, ValueError) as exc:  # xgrammar reports a bad schema/grammar as a RuntimeError from C++
        raise ValueError(f"cannot compile this {spec.kind}: {_short(exc)}") from None


def _short(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip()
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


class GrammarCompiler:
    """Compiles specs against one tokenizer's vocabulary, once each (LRU by spec); `cache` False:
    every `compile_uncached` call compiles afresh and nothing is kept (the front end's checker,
    which keeps only verdicts)."""

    def __init__(self, model_dir: str | Path, vocab_size: int, stop_token_ids: Sequence[int],
                 cache: bool = True) -> None:
        self.model_dir, self.vocab_size, self.stop_token_ids = str(model_dir), vocab_size, list(stop_token_ids)
        self._cache = cache
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()  # engine threads in one test process share nothing else, but may share this
        self.compile = functools.lru_cache(maxsize=_CACHE_SIZE)(self.compile_uncached)

    def load(self) -> None:
        """Load the tokenizer now rather than on the first compile (a ValueError if it cannot be)."""
        self._tokenizer_compiler()

    def _tokenizer_compiler(self) -> xgr.GrammarCompiler:
        """Loaded on the first structured request: engines that never see one never pay for it."""
        with self._lock:
            if self._compiler is None:
                from transformers import AutoTokenizer

                try:
                    tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
                except (OSError, ValueError) as exc:
                    raise ValueError(f"grammar: this model has no usable tokenizer ({exc})") from None
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=self._cache)
            return self._compiler

    def compile_uncached(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        grammar = build_grammar(spec)
        return self._tokenizer_compiler().compile_grammar(grammar)


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask [R, ceil(V / 32)] as a bool mask [R, V] (bit i of word w: token 32w + i)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab_size].astype(bool))


class DraftWalk:
    """Drafts that the grammar allows: draft j of each row is picked under the mask of its matcher
    after drafts[:j], which the walk feeds it; `close` rolls every matcher back to where it was.
    A row without a grammar, or whose walk is over (stop token, refused draft), is unmasked."""

    def __init__(self, matchers: list[xgr.GrammarMatcher | None], vocab_size: int) -> None:
        self.matchers, self.vocab_size = matchers, vocab_size
        self.walked = [0] * len(matchers)
        self.alive = [m is not None and not m.is_terminated() for m in matchers]
        self._bitmask = torch.full((len(matchers), (vocab_size + 31) // 32), -1, dtype=torch.int32)

    def mask(self) -> torch.Tensor:
        self._bitmask.fill_(-1)
        for row, matcher in enumerate(self.matchers):
            if self.alive[row]:
                matcher.fill_next_token_bitmask(self._bitmask, row)
        return _unpack(self._bitmask, self.vocab_size)

    def accept(self, tokens: Sequence[int]) -> None:
        for row, matcher in enumerate(self.matchers):
            if self.alive[row]:
                self.alive[row] = matcher.accept_token(int(tokens[row]))
                if self.alive[row]:
                    self.walked[row] += 1
                    self.alive[row] = not matcher.is_terminated()

    def close(self) -> None:
        for matcher, n in zip(self.matchers, self.walked):
            if n:
                matcher.rollback(n)
        self.walked = [0] * len(self.matchers)


class GrammarStates:
    """One matcher per slot (None: the slot's request is unconstrained)."""

    def __init__(self, max_num_seqs: int, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.matchers: list[xgr.GrammarMatcher | None] = [None] * max_num_seqs
        self.num_active = 0  # slots with a matcher: 0 lets every per-step check skip the batch loop
        self._bitmask = xgr.allocate_token_bitmask(1, compiler.vocab_size)

    def admit(self, slot: int, spec: GrammarSpec | None, output_token_ids: Sequence[int],
              compiled: xgr.CompiledGrammar | None = None) -> None:
        """I2: every admission sets the slot's matcher, so a new occupant never inherits one.
        `compiled`: the spec's grammar, compiled before admission (an engine step must not compile)."""
        self.release(slot)
        if spec is None:
            return
        matcher = xgr.GrammarMatcher(compiled if compiled is not None else self.compiler.compile(spec))
        for i, token in enumerate(output_token_ids):
            if not matcher.accept_token(int(token)):
                # Only a peer that ignored the grammar (t0 from P) gets here; the engine loop goes on.
                logger.error("grammar: slot %d: output token %d (%d) it arrived with is outside its grammar; "
                             "the rest of the request is unconstrained", slot, i, token)
                return
        self.matchers[slot] = matcher
        self.num_active += 1

    def release(self, slot: int) -> None:
        if self.matchers[slot] is not None:
            self.matchers[slot] = None
            self.num_active -= 1

    def any_active(self, slots: Sequence[int]) -> bool:
        return self.num_active > 0 and any(self.matchers[s] is not None for s in slots)

    def position_masks(self, slots: Sequence[int], drafts: Sequence[Sequence[int]]) -> torch.Tensor:
        """[sum(1 + len(d)), V] bool: the tokens allowed at every verified position, rows in the
        sampler's order (per slot: its drafts' positions, then the bonus position)."""
        words = self._bitmask.shape[1]
        rows = sum(1 + len(d) for d in drafts)
        bitmask = torch.full((rows, words), -1, dtype=torch.int32)
        row = 0
        for slot, window in zip(slots, drafts):
            matcher = self.matchers[slot]
            if matcher is not None:
                self._fill_window(matcher, window, bitmask, row)
            row += 1 + len(window)
        return _unpack(bitmask, self.compiler.vocab_size)

    def draft_walk(self, slots: Sequence[int]) -> DraftWalk | None:
        """For a drafter: masks for draft j of each slot after drafts[:j]; None when no slot has a
        grammar (the drafter then runs exactly as without structured output)."""
        if not self.any_active(slots):
            return None
        return DraftWalk([self.matchers[s] for s in slots], self.compiler.vocab_size)

    def valid_prefix(self, slot: int, drafts: Sequence[int]) -> int:
        """How many leading drafts the slot's grammar accepts (all of them without a grammar)."""
        matcher = self.matchers[slot]
        if matcher is None:
            return len(drafts)
        n = 0
        while n < len(drafts) and not matcher.is_terminated() and matcher.accept_token(int(drafts[n])):
            n += 1
        if n:
            matcher.rollback(n)
        return n

    @staticmethod
    def _fill_window(matcher: xgr.GrammarMatcher, window: Sequence[int], bitmask: torch.Tensor, row: int) -> None:
        walked = 0
        for j in range(len(window) + 1):
            if matcher.is_terminated():
                break  # past a stop token nothing is kept: leave the rest unmasked
            matcher.fill_next_token_bitmask(bitmask, row + j)
            if j == len(window) or not matcher.accept_token(int(window[j])):
                break  # a refused draft: later positions are never kept
            walked += 1
        if walked:
            matcher.rollback(walked)

    def advance(self, slot: int, token_ids: Sequence[int]) -> None:
        """Accept the tokens a step kept (accepted drafts plus the bonus token)."""
        matcher = self.matchers[slot]
        if matcher is None:
            return
        for token in token_ids:
            if matcher.is_terminated():
                return  # tokens after the stop token are dropped by the scheduler
            if not matcher.accept_token(int(token)):
                # The mask forbids this (a bug if reached); never end the engine loop over it.
                logger.error("grammar: slot %d kept token %d that its grammar refuses; the rest of the "
                             "request is unconstrained", slot, token)
                self.matchers[slot] = None
                return
