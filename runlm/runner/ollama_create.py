"""Ollama's blob upload and ``/api/create`` for LoRA adapters: ``ollama.create_blob(file)`` for each adapter
file, then ``ollama.create(model=NAME, from_=BASE, adapters={file: digest})``.

runlm's /api/create makes NAME a LoRA adapter of the stored model BASE, served by BASE's native backend
(the same mechanism as ``runlm configure BASE --lora NAME=PATH``, runlm/runner/lora.py): like every
``_configure`` setting it lasts while the daemon runs. With ``quantize`` it stores a quantized copy of BASE (a
GGUF model) as NAME (``ollama create NAME --quantize q4_K_M``), streaming the quantizer's progress. Building new
models from files or Modelfiles is not something /api/create does here (pull them instead), and says so.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
from dataclasses import replace
from pathlib import Path

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
from runlm.store.progress import ProgressCallback
from runlm.web.openapi import OllamaError, json_body

router = APIRouter(prefix="/api")


class CreateAdapterRequest(_Body):
    model: StrictStr = Field(min_length=1)
    from_: StrictStr | None = Field(None, alias="from")
    adapters: dict[str, StrictStr] | None = None
    quantize: StrictStr | None = None
    stream: StrictBool | None = None


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


@router.post("/create", openapi_extra=json_body(CreateAdapterRequest, error=OllamaError))
async def create(request: Request) -> Response:
    body = await body_json(request, CreateAdapterRequest)
    base_name, adapters, name = body.get("from"), body.get("adapters"), body["model"]
    if body.get("quantize") is not None:
        return await _quantize(request, body)
    if not base_name or not adapters:
        raise BadRequest("runlm's /api/create makes a LoRA adapter of a stored model ('from' and 'adapters': "
                         "{file name: blob digest}) or a quantized copy of one ('from' and 'quantize'); pull models "
                         "to add them", param="adapters")
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


async def _quantize(request: Request, body: dict) -> Response:
    """``from`` (a stored GGUF model) quantized as ``quantize`` and stored as ``model``, with progress lines."""
    from runlm.quantize.plan import file_type
    from runlm.store.quantized import quantize_into_store, source_file

    if not body.get("from") or body.get("adapters"):
        raise BadRequest("'quantize' makes a quantized copy of the stored model named by 'from' (no adapters)",
                         param="from")
    try:
        file_type(body["quantize"])
    except ValueError as exc:
        raise BadRequest(str(exc), param="quantize") from None
    store = request.app.state.store

    def job(put: ProgressCallback) -> str:  # (a QuantizeError is a ValueError: the client's 400)
        file = source_file(store, body["from"], local_files=False)  # an HTTP client names stored models only
        return quantize_into_store(store, file, body["model"], body["quantize"], progress=put)[1]

    return await progress_response(body, transfer_events(job))
