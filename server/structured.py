"""`response_format` -> the engine's GrammarSpec. Whether the grammar engine can compile it, in
budget, is checked off the event loop (server/grammar_pool.py); a bad one is a 400 naming it."""
from __future__ import annotations

import json

from engine.types import GrammarKind, GrammarSpec
from server.errors import APIError
from server.grammar_pool import GrammarChecker
from server.openai_schemas import ResponseFormat

SCHEMA_PARAM = "response_format.json_schema.schema"


def response_format_grammar(rf: ResponseFormat | None) -> GrammarSpec | None:
    """None for plain text; json_object and json_schema (strict or not: the output always follows
    the schema) become grammars, not yet checked (`checked_response_format`)."""
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
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(rf.json_schema.schema_, ensure_ascii=False))


async def checked_response_format(grammars: GrammarChecker, spec: GrammarSpec | None) -> GrammarSpec | None:
    if spec is None:
        return None
    return await grammars.check(spec, SCHEMA_PARAM if spec.kind == GrammarKind.JSON_SCHEMA else "response_format")
