"""The request bodies in /openapi.json.

The generation routes read their body themselves (server/app.py's `_Gate`: the API key and the
body size come before parsing), so FastAPI cannot see their models. Each route names its models
here (`request_body`), and `add_request_schemas` puts the models' JSON schemas under
`components/schemas`, so tools that read the document (clients, schemathesis) see every field.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"
_MODELS_KEY = "x-pdserve-models"  # where request_body leaves its models' names for add_request_schemas
_MODELS: dict[str, type[BaseModel]] = {}  # every model request_body was given, by name


def request_body(*models: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is one of `models`."""
    refs = [{"$ref": _REF.format(model=m.__name__)} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            _MODELS_KEY: [_MODELS.setdefault(m.__name__, m).__name__ for m in models]}


def add_request_schemas(app: FastAPI) -> None:
    """Make `app.openapi()` include the schemas of every model named by `request_body`."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for path in doc.get("paths", {}).values():
                for operation in path.values():
                    for name in operation.pop(_MODELS_KEY, []):
                        _add_model(schemas, _MODELS[name])
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi


def _add_model(schemas: dict[str, Any], model: type[BaseModel]) -> None:
    schema = model.model_json_schema(ref_template=_REF, mode="validation")
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema
