"""OpenAPI for routes that parse their own JSON bodies (so that every malformed body is our 400, never
FastAPI's 422): ``openapi_extra=json_body(Model)`` on the route documents the model its handler parses,
and ``install_openapi`` serves the document at /openapi.json and Swagger UI at /docs."""
from __future__ import annotations

import json
import re
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"
_VALIDATION: Literal["validation"] = "validation"  # the schema of what a request may send
_MODELS: dict[str, type[BaseModel]] = {}  # every model a route names, by schema name


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    """The error body of every OpenAI-style route."""
    error: OpenAIErrorDetail


class OllamaError(BaseModel):
    """The error body of Ollama's /api routes."""
    error: str


def _ref(model: type[BaseModel]) -> dict[str, str]:
    _MODELS[model.__name__] = model
    return {"$ref": _REF.format(model=model.__name__)}


def json_body(model: type[BaseModel] | None = None, error: type[BaseModel] = OpenAIError,
              required: bool = True) -> dict[str, Any]:
    """The route's request body (``model``, as its handler parses it) and error responses, for ``openapi_extra``."""
    errors = {"description": "an error", "content": {"application/json": {"schema": _ref(error)}}}
    extra: dict[str, Any] = {"responses": {"4XX": errors, "5XX": errors}}
    if model is not None:
        extra["requestBody"] = {"required": required, "content": {"application/json": {"schema": _ref(model)}}}
    return extra


def install_openapi(app: FastAPI, title: str, version: str, description: str) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=title, version=version, description=description, routes=app.routes)
            names = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(doc)))
            used = [(_MODELS[n], _VALIDATION) for n in sorted(names) if n in _MODELS]
            _, defs = models_json_schema(used, ref_template=_REF)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
