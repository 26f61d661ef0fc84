"""The server's OpenAPI document with the request bodies in it.

The generation and tokenizer routes read their bodies themselves (serving_engine.read_json_body: size
and time limits, strict JSON, 400s in OpenAI's shape), so FastAPI cannot see their models.  Here each
such route's body is declared from its pydantic model, with the models' shared parts as components:
what clients, code generators and the suite's API fuzzer (tests/entrypoints/test_api_fuzz.py) read.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


def with_request_bodies(schema: dict[str, Any], bodies: dict[str, type[BaseModel]]) -> dict[str, Any]:
    """schema (an OpenAPI document) with a JSON requestBody on each POST path of bodies (path -> model)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in bodies.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        op = schema["paths"][path]["post"]
        op["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return schema


def install_openapi(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """app.openapi() built once, with the request bodies of `bodies`."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = with_request_bodies(
                get_openapi(title=app.title, version=app.version, routes=app.routes), bodies)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
