"""The daemon's request bodies (pydantic), for the routes it answers itself: what each handler validates
before it reads the fields, and what /openapi.json documents. Unknown fields are allowed (clients send
more than we use); the types of the fields we read are checked, so a wrong one is a 400 naming it."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)


class CreateRequest(_Body):
    """POST /models/create: a built-in name, a URL or a Hugging Face id (local paths: see --allow-local-import)."""
    from_: StrictStr = Field(alias="from", min_length=1)
    name: StrictStr | None = None
    insecure: StrictBool | None = None  # a registry reference over plain http


class PushRequest(_Body):
    """POST /models/{name}/push: where to (a registry reference; default: where the model came from)."""
    target: StrictStr | None = None
    insecure: StrictBool | None = None


class TagRequest(_Body):
    target: StrictStr | None = None


class UnloadRequest(_Body):
    models: list[StrictStr] | None = None
    all: StrictBool | None = None
    backend: StrictStr | None = None


class ConfigureRequest(_Body):
    """POST /engines/_configure; the keys are Docker Model Runner's (snake_case spellings are accepted too)."""
    model: StrictStr = Field(min_length=1)
    context_size: StrictInt | None = Field(None, alias="context-size")
    runtime_flags: list[StrictStr] | StrictStr | None = Field(None, alias="runtime-flags")
    keep_alive: StrictStr | float | None = None
    speculative: dict[str, Any] | None = None
    llamacpp: dict[str, Any] | None = None
    vllm: dict[str, Any] | None = None
    loras: dict[str, dict[str, StrictStr]] | None = None  # LoRA name -> {file name: blob digest}


class ModelRequest(_Body):
    """Ollama's /api/show, /api/pull, /api/delete: ``model`` (or its older name, ``name``)."""
    model: StrictStr | None = None
    name: StrictStr | None = None
    stream: StrictBool | None = None
    force: StrictBool | None = None
    insecure: StrictBool | None = None  # /api/pull, /api/push: a registry over plain http


class CopyRequest(_Body):
    source: StrictStr
    destination: StrictStr


class _Ollama(_Body):
    model: StrictStr = Field(min_length=1)
    options: dict[str, Any] | None = None
    shift: StrictBool | None = None     # a generation that fills the context goes on (default: yes, as Ollama's)
    truncate: StrictBool | None = None  # chat: the oldest messages dropped to fit the context (default: yes)
    keep_alive: StrictStr | float | None = None
    stream: StrictBool | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None


class GenerateRequest(_Ollama):
    prompt: StrictStr | None = None
    system: StrictStr | None = None
    template: StrictStr | None = None  # a prompt template (Ollama's Go, or Jinja) instead of the model's
    suffix: StrictStr | None = None  # fill-in-the-middle: the text after the gap
    raw: StrictBool | None = None
    format: StrictStr | dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # runlm's extension, as on /v1/chat/completions
    think: StrictBool | StrictStr | None = None
    images: list[Any] | None = None
    width: StrictInt | None = None   # image generation models
    height: StrictInt | None = None
    steps: StrictInt | None = None


class ChatRequest(_Ollama):
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    format: StrictStr | dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # runlm's extension, as on /v1/chat/completions
    think: StrictBool | StrictStr | None = None  # a reasoning model's thinking: on, off, or low/medium/high


class EmbedRequest(_Ollama):
    input: StrictStr | list[StrictStr] | None = None
    dimensions: StrictInt | None = None


class EmbeddingsRequest(_Ollama):
    prompt: StrictStr | None = None


class OpenAIRequest(_Body):
    """/v1/... (and /engines/...): forwarded to the model's backend, which checks the rest; ``keep_alive``
    is the daemon's own extra."""
    model: StrictStr = Field(min_length=1)
    keep_alive: StrictStr | float | None = None
