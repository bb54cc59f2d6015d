"""LoRA adapters over HTTP (vLLM's routes and bodies): ``POST /v1/load_lora_adapter`` {lora_name, lora_path}
and ``POST /v1/unload_lora_adapter`` {lora_name}; a request's ``model`` then names the adapter, and
``/v1/models`` lists it with ``parent`` set to the base model.

These routes make the server read files named by the client, so they sit behind the API key (when one
is set) and answer only where LoRA was enabled (``--enable-lora``). The server gives each adapter name
its own ``lora_int_id``; an adapter the engine later evicts is loaded again from its path on its next use.
"""
from __future__ import annotations

import itertools
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from runlm.engine.async_inproc import AsyncLLM
from runlm.engine.types.errors import LoRAError
from runlm.engine.types.lora_request import LoRARequest
from runlm.server.body import parse_body
from runlm.server.errors import APIError, bad_request
from runlm.server.state import ServerState
from runlm.web.openapi import json_body

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


_ids = itertools.count(1)


def new_lora_request(name: str, path: str, base: str) -> LoRARequest:
    return LoRARequest(name, next(_ids), path, base_model_name=base)


def _enabled(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    if not state.settings.enable_lora:
        raise APIError(400, "LoRA adapters are not enabled on this server (start it with --enable-lora)",
                       code="lora_not_enabled")
    return state


@router.post("/v1/load_lora_adapter", openapi_extra=json_body(LoadLoRAAdapterRequest))
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    state = _enabled(request)
    req = await parse_body(request, LoadLoRAAdapterRequest)
    engine = state.ready_engine()
    if req.lora_name in state.loras:
        raise bad_request(f"The lora adapter '{req.lora_name}' has already been loaded.", "lora_name")
    if req.lora_name in state.settings.served_model_names:
        raise bad_request(f"'{req.lora_name}' is the base model's name", "lora_name")
    lora = new_lora_request(req.lora_name, req.lora_path, state.model_name)
    try:
        await engine.add_lora(lora)
    except LoRAError as exc:
        raise bad_request(str(exc), "lora_path", "invalid_lora_adapter") from None
    state.loras[lora.lora_name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", openapi_extra=json_body(UnloadLoRAAdapterRequest))
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    state = _enabled(request)
    req = await parse_body(request, UnloadLoRAAdapterRequest)
    engine = state.ready_engine()
    lora = state.loras.get(req.lora_name)
    if lora is None or (req.lora_int_id is not None and req.lora_int_id != lora.lora_int_id):
        raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name",
                       code="lora_not_found")
    del state.loras[req.lora_name]  # new requests stop naming it at once; running ones finish with it
    await engine.remove_lora(lora.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


async def load_startup_adapters(state: ServerState, engine: AsyncLLM) -> None:
    """The adapters named at start (--lora-modules); one that cannot load fails the start."""
    for name, path in state.settings.lora_modules.items():
        lora = new_lora_request(name, path, state.model_name)
        await engine.add_lora(lora)
        state.loras[name] = lora


def adapter_cards(state: ServerState, created: int) -> list[dict[str, Any]]:
    """/v1/models entries for the adapters: ``root`` is the adapter's path, ``parent`` the base model."""
    return [{"id": name, "object": "model", "created": created, "owned_by": "runlm", "root": lora.lora_path,
             "parent": lora.base_model_name or state.model_name} for name, lora in state.loras.items()]
