"""What a running server knows: its settings, its engine (once loaded) and the requests in flight."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runlm.server.errors import APIError, not_ready
from runlm.server.media import MediaSettings

if TYPE_CHECKING:
    from runlm.engine.async_inproc import AsyncLLM
    from runlm.engine.types.lora_request import LoRARequest
    from runlm.server.metrics import ServerMetrics

MiB = 1 << 20
# a request body holds an image as base64 (4/3 of its bytes): the default lets the largest image runlm decodes
# (runlm.models.vision.images.MAX_IMAGE_BYTES, 20 MiB) through, with room for the rest of the conversation
DEFAULT_MAX_BODY = 32 * MiB


@dataclass(slots=True)
class ServerSettings:
    served_model_names: list[str]            # the first is the name we answer with
    api_key: str | tuple[str, ...] | None = None  # one key or several
    cors_origins: list[str] = field(default_factory=list)
    max_body_bytes: int = DEFAULT_MAX_BODY
    # sequences that may wait for a slot beyond the engine's max_num_seqs before we answer 503
    max_waiting: int = 256
    max_prompts_per_request: int = 256
    # let a request replace the model's chat template (chat_template_kwargs.chat_template; vLLM's flag)
    trust_request_chat_template: bool = False
    # LoRA adapters (--enable-lora): requests name them in "model"; /v1/load_lora_adapter adds more
    enable_lora: bool = False
    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> path, loaded before the server is ready
    # what a request leaves out: the model's recommended sampling settings under --override-generation-config
    # (SamplingParams field -> value, and "stop": a Modelfile's stop strings; runlm.server.sampling applies it)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # --reasoning-parser: "auto" (from the chat template), "none", or a parser's name (runlm.tools.reasoning)
    reasoning_parser: str = "auto"
    # --context-shift: generations that fill the context go on (runlm/server/context_shift.py) unless a request
    # says context_shift: false
    context_shift: bool = False
    # images: the hosts image URLs are fetched from (--allowed-media-domains), size limits, images per prompt
    media: MediaSettings = field(default_factory=MediaSettings)


@dataclass(slots=True)
class ServerState:
    settings: ServerSettings
    metrics: ServerMetrics
    engine: AsyncLLM | None = None
    load_error: BaseException | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    in_flight_seqs: int = 0                  # sequences admitted and not yet finished
    draining: bool = False                   # SIGTERM: finishing what runs, taking nothing new
    scaling: bool = False                    # a /scale_elastic_ep is under way (runlm.server.engine_ops)
    loras: dict[str, LoRARequest] = field(default_factory=dict)  # adapter name -> its request (runlm.server.lora)

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    def ready_engine(self) -> AsyncLLM:
        """The engine, or a 503 while it loads (or when it failed) and once the server is shutting down."""
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another", code="shutting_down",
                           headers={"Retry-After": "1"})
        if self.engine is None:
            if self.load_error is not None:
                raise APIError(503, f"the model failed to load: {self.load_error}", code="model_load_failed")
            raise not_ready()
        return self.engine

    def check_model(self, requested: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's model names (None: the base model). A request naming another model
        is misdirected (421): a backend serves exactly one model."""
        if requested and requested in self.loras:
            return self.loras[requested]
        if requested and requested not in self.settings.served_model_names:
            raise APIError(421, f"this server serves the model {self.model_name!r}, not {requested!r}",
                           param="model", code="model_not_served")
        return None

    def require_task(self, task: str, what: str) -> AsyncLLM:
        engine = self.ready_engine()
        if task not in engine.get_supported_tasks():
            raise APIError(400, f"this model does not support {what}", param="model", code="unsupported_task")
        return engine
