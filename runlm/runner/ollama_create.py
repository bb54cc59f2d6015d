"""Ollama's blob upload and ``/api/create``: what ``ollama create -f Modelfile`` and ``ollama.create(...)`` send.

- ``template`` / ``system`` / ``parameters`` / ``messages`` / ``license`` (and ``adapters`` with them), ``from``
  a stored model or ``files`` (``{file name: blob digest}``, uploaded with ``create_blob``): a new stored model
  with those defaults (runlm/store/modelfile_model.py);
- ``quantize``: a quantized copy of ``from`` (a GGUF model), the settings above put on it when given;
- ``from`` and ``adapters`` alone: NAME becomes a LoRA adapter of BASE served by BASE's native backend (as
  ``runlm configure BASE --lora NAME=PATH``, runlm/runner/lora.py), lasting while the daemon runs.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field, StrictBool, StrictStr
from starlette.responses import JSONResponse, Response

from runlm.runner.config import ConfigError
from runlm.runner.errors import BadRequest
from runlm.runner.lora import parse_loras
from runlm.runner.models_api import body_json
from runlm.runner.ollama_stream import NDJSON
from runlm.runner.pulling import progress_response, transfer_events
from runlm.runner.requests import _Body
from runlm.store.blobs import check_digest
from runlm.store.modelfile_model import ModelSpec, ModelSpecError, build_model, check_spec, model_from_blobs
from runlm.store.progress import ProgressCallback, PullProgress
from runlm.web.openapi import OllamaError, json_body

router = APIRouter(prefix="/api")


class CreateRequest(_Body):
    model: StrictStr = Field(min_length=1)
    from_: StrictStr | None = Field(None, alias="from")
    files: dict[str, StrictStr] | None = None
    adapters: dict[str, StrictStr] | None = None
    template: StrictStr | None = None
    system: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    messages: list[dict[str, Any]] | None = None
    license: StrictStr | list[StrictStr] | None = None
    quantize: StrictStr | None = None
    stream: StrictBool | None = None


SPEC_FIELDS = ("files", "template", "system", "parameters", "messages", "license")


def _digest(digest: str) -> str:
    try:
        return check_digest(digest)
    except ValueError as exc:
        raise BadRequest(str(exc), param="digest") from None


@router.head("/blobs/{digest}", include_in_schema=False)  # a HEAD answer has no body for a schema to describe
async def has_blob(request: Request, digest: str) -> Response:
    return Response(status_code=200 if request.app.state.store.blobs.has(_digest(digest)) else 404)


@router.post("/blobs/{digest}", openapi_extra=json_body(error=OllamaError, required=False))
async def upload_blob(request: Request, digest: str) -> Response:
    """The body is the file; it becomes a blob only if its sha256 is ``digest``."""
    blobs = request.app.state.store.blobs
    if blobs.has(_digest(digest)):
        async for _ in request.stream():  # drain what the client sends
            pass
        return Response(status_code=200)
    blobs.tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=blobs.tmp, prefix="upload-")
    tmp, h = Path(name), hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            async for chunk in request.stream():
                h.update(chunk)
                await asyncio.to_thread(out.write, chunk)
        if "sha256:" + h.hexdigest() != digest:
            raise BadRequest(f"the uploaded file's digest is sha256:{h.hexdigest()}, not {digest}", param="digest")
        blobs.adopt(tmp, digest)
    finally:
        tmp.unlink(missing_ok=True)
    return Response(status_code=201)


@router.post("/create", openapi_extra=json_body(CreateRequest, error=OllamaError))
async def create(request: Request) -> Response:
    body = await body_json(request, CreateRequest)
    base_name, adapters, name = body.get("from"), body.get("adapters"), body["model"]
    if body.get("quantize") is not None or any(body.get(k) is not None for k in SPEC_FIELDS):
        return await _create_model(request, body)
    if not base_name or not adapters:
        raise BadRequest("/api/create needs 'from' (a stored model) or 'files' ({file name: blob digest}), with "
                         "what the new model changes: 'template', 'system', 'parameters', 'messages', 'license', "
                         "'adapters' or 'quantize'", param="from")
    name = name.removesuffix(":latest")
    try:
        loras = parse_loras({name: adapters})
    except ConfigError as exc:
        raise BadRequest(str(exc), param="adapters") from None
    loader = request.app.state.loader
    base = await loader.model(base_name)
    backend = loader.backend(None, base)
    config = loader.config_for(base, backend.name)
    config = replace(config, loras={**config.loras, **loras})
    try:
        backend.check_config(config)
    except ConfigError as exc:
        raise BadRequest(str(exc), param="from") from None
    await loader.configure(base, None, config)
    status = {"status": "success"}
    if body.get("stream") is False:
        return JSONResponse(status)
    return Response(b'{"status":"using existing layer"}\n' + b'{"status":"success"}\n',
                    media_type=NDJSON)


def _spec(body: dict) -> ModelSpec:
    license = body.get("license")
    spec = ModelSpec(template=body.get("template"), system=body.get("system"),
                     parameters=dict(body.get("parameters") or {}), messages=list(body.get("messages") or []),
                     license=[license] if isinstance(license, str) else list(license or []),
                     adapters={k: _digest(v) for k, v in (body.get("adapters") or {}).items()})
    try:
        check_spec(spec)
    except ModelSpecError as exc:
        raise BadRequest(str(exc), param=exc.param) from None
    return spec


async def _create_model(request: Request, body: dict) -> Response:
    """A new stored model: ``from`` (quantized first with ``quantize``) or ``files``, with the body's defaults."""
    from runlm.quantize.plan import file_type

    spec, name = _spec(body), body["model"]
    if (body.get("from") is None) == (body.get("files") is None):
        raise BadRequest("give exactly one of 'from' (a stored model) and 'files' ({file name: blob digest})",
                         param="from")
    if body.get("quantize") is not None:
        try:
            file_type(body["quantize"])
        except ValueError as exc:
            raise BadRequest(str(exc), param="quantize") from None
    files = {k: _digest(v) for k, v in (body.get("files") or {}).items()}
    store = request.app.state.store

    def job(put: ProgressCallback) -> str:  # (a QuantizeError or ModelSpecError is a ValueError: the client's 400)
        base = model_from_blobs(store, name, files) if files else store.ensure(body["from"], put)
        model = build_model(store, name, base, spec, body.get("quantize"), put)
        put(PullProgress("success"))
        return str(model.name)

    return await progress_response(body, transfer_events(job))
