"""runlm's OpenAI-compatible server as a Ray Serve application, for people who already run Ray Serve.

    serve run runlm.serve.ray:app model=smollm2 max_replicas=4
    serve run examples/ray-serve.yaml        # the same, from a Serve config file

``app`` is a Serve application builder: it takes the ``key=value`` arguments (or a config's ``args``),
checks them (``RayServeArgs``) and returns the bound deployment. Each Serve replica is an actor that
loads the model on its node (the same store name, resolved there) into an ``AsyncLLM`` and serves
runlm's own HTTP app (``runlm.server.build_app``: every route of ``runlm serve-engine``) behind Serve's
proxy. Serve scales the replicas on queue depth (``target_ongoing_requests`` per replica, between
``min_replicas`` and ``max_replicas``) and replaces one whose ``check_health`` fails (a dead engine thread).
"""
from __future__ import annotations

import asyncio
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray import serve
from ray.serve import Application

from runlm.engine.async_llm import AsyncLLM
from runlm.server import ServerSettings, build_app
from runlm.sizes import parse_size

__all__ = ["RayServeArgs", "RunlmDeployment", "app"]


class RayServeArgs(BaseModel):
    """The application's arguments; unknown names are refused (no arbitrary flags reach the engine)."""
    model_config = ConfigDict(extra="forbid")

    model: str = Field("smollm2", description="built-in name, .gguf file or model directory, resolved on each node")
    served_model_name: list[str] | None = Field(None, description="names clients use (default: model)")
    api_key: str | None = Field(default_factory=lambda: os.environ.get("RUNLM_API_KEY"),
                                description="require 'Authorization: Bearer KEY' (default: $RUNLM_API_KEY)")
    task: Literal["auto", "generate", "embed", "score"] = "auto"
    threads: int = Field(1, ge=1, description="CPU threads per replica: its Ray num_cpus and the kernels' threads")
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    max_model_len: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    kv_cache_memory: str | None = Field(None, description="bytes such as 2GiB")
    kv_cache_dtype: Literal["auto", "fp32", "fp16", "q8_0"] = "auto"
    max_waiting: int = Field(256, ge=0)
    max_body_size: str = "32MiB"
    # Serve's autoscaling on queue depth
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0, description="requests per replica Serve scales toward")
    max_ongoing_requests: int = Field(64, ge=1, description="requests one replica takes before Serve queues them")
    upscale_delay_s: float = Field(30.0, ge=0, description="how long the queue must stay long before Serve adds one")
    downscale_delay_s: float = Field(600.0, ge=0, description="how long it must stay short before Serve removes one")

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        return value.split(",") if isinstance(value, str) else value  # `serve run ... served_model_name=a,b`

    @model_validator(mode="after")
    def _check(self) -> RayServeArgs:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        parse_size(self.max_body_size)
        return self

    def engine_args(self) -> dict[str, Any]:
        args: dict[str, Any] = dict(task=self.task, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                                    max_num_batched_tokens=self.max_num_batched_tokens, device=self.device,
                                    kv_cache_memory=self.kv_cache_memory, kv_cache_dtype=self.kv_cache_dtype,
                                    threads=self.threads)
        if self.dtype or self.device.startswith("cuda"):
            args["dtype"] = self.dtype or "bfloat16"
        return args

    def settings(self) -> ServerSettings:
        return ServerSettings(served_model_names=self.served_model_name or [self.model], api_key=self.api_key,
                              max_body_bytes=parse_size(self.max_body_size), max_waiting=self.max_waiting)


@serve.deployment(name="runlm")
@serve.ingress()
class RunlmDeployment:
    """One Serve replica: the engine is loaded before Serve routes to it, then runlm's app serves it."""

    async def __init__(self, args: RayServeArgs) -> None:  # type: ignore[misc]  # Serve awaits it
        self.args = args
        self.engine = await asyncio.to_thread(AsyncLLM, args.model, **args.engine_args())

    def __serve_build_asgi_app__(self) -> Any:
        # the app's lifespan shuts the engine down when Serve stops the replica
        return build_app(self.args.settings(), self.engine)

    async def check_health(self) -> None:
        """Serve's health check: a replica whose engine thread died is replaced."""
        self.engine.check_health_now()


def app(args: dict[str, Any] | RayServeArgs) -> Application:
    """The Serve application builder (``serve run runlm.serve.ray:app model=smollm2``)."""
    checked = args if isinstance(args, RayServeArgs) else RayServeArgs.model_validate(dict(args))
    return RunlmDeployment.options(  # type: ignore[attr-defined]  # serve.deployment made it a Deployment
        ray_actor_options={"num_cpus": checked.threads},
        max_ongoing_requests=checked.max_ongoing_requests,
        autoscaling_config={"min_replicas": checked.min_replicas, "max_replicas": checked.max_replicas,
                            "initial_replicas": max(checked.min_replicas, 1),
                            "target_ongoing_requests": checked.target_ongoing_requests,
                            "upscale_delay_s": checked.upscale_delay_s,
                            "downscale_delay_s": checked.downscale_delay_s},
    ).bind(checked)
