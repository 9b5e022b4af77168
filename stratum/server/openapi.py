"""The served OpenAPI document (`/openapi.json`) with each JSON route's request body: the routes read their
bodies themselves (`body.read_request`), so FastAPI cannot see them; `describe_bodies` adds each route's
pydantic model, its nested models under `components/schemas`. Fuzzers (tests/test_fuzz.py) and `/docs` read it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def describe_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make `app.openapi()` give `bodies[path]` as the request body of `POST path`.

    Args:
        bodies: the path of a POST route -> the model its body is validated as.
    """
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = build()
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            operation = doc.get("paths", {}).get(path, {}).get("post")
            if operation is None:
                continue
            schema = model.model_json_schema(ref_template=_REF)
            for name, definition in schema.pop("$defs", {}).items():
                assert components.get(name, definition) == definition, f"two request models named {name}"
                components[name] = definition
            components[model.__name__] = schema
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
