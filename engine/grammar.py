"""Checking a structured-output grammar without a tokenizer, for the front end (a bad schema is a
400 there, before any engine sees it). The engine compiles the same spec, cached, against its
vocabulary (worker/structured.py); this module only re-exposes the tokenizer-free half."""
from __future__ import annotations

from engine.types import GrammarSpec
from worker.structured import build_grammar


def check_grammar(spec: GrammarSpec) -> None:
    """Raises ValueError saying why `spec` cannot be compiled."""
    build_grammar(spec)
