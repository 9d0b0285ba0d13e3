"""What a structured-output grammar spec may hold, checked without compiling it.

Shared by the front end (a 400 naming the field) and the engines (which re-check what arrives on
the wire): a JSON schema may only `$ref` into itself. xgrammar ignores a `$ref` it cannot resolve,
so a remote one (`http://...`) or one into another document would silently leave part of the schema
unenforced; nothing here fetches anything.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

from engine.types import GrammarKind, GrammarSpec

# Above these sizes a spec is refused before anyone compiles it: compiling costs time that grows
# with the spec (an `enum` of many strings), and a fair client's schema is far smaller.
DEFAULT_MAX_GRAMMAR_BYTES = 1024 * 1024
# The front end's time budget for compiling one spec (server/grammar_pool.py): over it, a 400.
DEFAULT_GRAMMAR_TIMEOUT_S = 10.0
# JSON-schema keywords whose values are data, not schemas: a `$ref` key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "example"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def spec_compiler(model_dir: str | None, vocab_size: int,
                  stop_token_ids: Sequence[int]) -> Callable[[GrammarSpec], None]:
    """For a process that only checks specs (the front end's grammar workers): a function that
    compiles a spec as the engines will (`model_dir` None: no tokenizer, the grammar alone), keeps
    nothing, and raises ValueError saying why a spec does not compile. Loads the tokenizer now."""
    from worker.structured import GrammarCompiler, build_grammar  # torch and xgrammar: only where used

    if model_dir is None:
        return build_grammar
    compiler = GrammarCompiler(model_dir, vocab_size, stop_token_ids, cache=False)
    compiler.load()
    return compiler.compile_uncached


def spec_key(spec: GrammarSpec) -> str:
    """A stable digest of a spec: the key of the compile caches."""
    return hashlib.sha256(f"{spec.kind}\0{spec.text}".encode()).hexdigest()


def spec_size(spec: GrammarSpec) -> int:
    return len(spec.text.encode("utf-8", "surrogatepass"))


def check_refs(spec: GrammarSpec) -> None:
    """Raises ValueError for a `$ref` that does not point into the schema itself (`#...`)."""
    if spec.kind == GrammarKind.JSON_OBJECT or "$ref" not in spec.text:
        return
    try:
        doc = json.loads(spec.text)
    except ValueError:
        return  # not JSON: the compiler refuses it with its own message
    except RecursionError:
        raise ValueError("the schema is nested too deeply") from None
    if (ref := _non_local_ref(doc)) is not None:
        raise ValueError(f"$ref {ref[:200]!r} is not a local reference (only '#...' references into the "
                         "schema itself are supported; nothing is fetched)")


def _non_local_ref(doc: Any) -> str | None:
    # Iterative (a schema may be nested as deep as the JSON parser allowed). A node is a schema, or
    # a map from names to schemas (`properties`), whose keys are names, not keywords.
    stack: list[tuple[Any, bool]] = [(doc, False)]
    while stack:
        node, is_map = stack.pop()
        if isinstance(node, dict):
            ref = None if is_map else node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return ref
            for key, value in node.items():
                if is_map or key not in _DATA_KEYWORDS:
                    stack.append((value, not is_map and key in _SCHEMA_MAPS))
        elif isinstance(node, list):
            stack.extend((v, False) for v in node)
    return None
