"""`response_format` -> the engine's GrammarSpec, checked here so that a schema the grammar engine
cannot compile is a 400 naming it (the engine compiles the same spec again, cached)."""
from __future__ import annotations

import json

from engine.grammar import check_grammar
from engine.types import GrammarKind, GrammarSpec
from server.errors import APIError
from server.openai_schemas import ResponseFormat


def checked_grammar(spec: GrammarSpec, param: str) -> GrammarSpec:
    try:
        check_grammar(spec)
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None
    return spec


def response_format_grammar(rf: ResponseFormat | None) -> GrammarSpec | None:
    """None for plain text; json_object and json_schema (strict or not: the output always follows
    the schema) become grammars."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT)
    if rf.type != "json_schema":
        raise APIError(400, f"response_format.type must be 'text', 'json_object' or 'json_schema', got {rf.type!r}",
                       param="response_format.type")
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise APIError(400, "response_format.json_schema.schema is required for type 'json_schema'",
                       param="response_format.json_schema")
    # Key order is kept: the grammar emits properties in the schema's order.
    text = json.dumps(rf.json_schema.schema_, ensure_ascii=False)
    return checked_grammar(GrammarSpec(GrammarKind.JSON_SCHEMA, text), "response_format.json_schema.schema")
