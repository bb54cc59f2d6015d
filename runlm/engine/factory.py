"""Which engine core a model gets: LLMEngine for one that generates, PoolingEngine for one that embeds
or scores. Neither engine imports the other; this module is the one place that knows both.

``engine_from_config`` takes a config whose ``model`` is already a path (the CLI resolves the name once
and builds the config once). ``engine_from_model`` is the convenience behind ``LLM(name)`` and
``AsyncLLM(name)``: it resolves a built-in name through the store, then does the same.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from runlm.engine.llm_engine import LLMEngine
from runlm.engine.pooling_engine import PoolingEngine
from runlm.engine.types.config import EngineConfig
from runlm.engine.types.spec_config import SpeculativeConfig
from runlm.models.spec import read_spec

EngineCoreType = LLMEngine | PoolingEngine


def engine_from_config(config: EngineConfig) -> EngineCoreType:
    """The engine core for the model at ``config.model``, read once (runlm.models.spec) for both the choice and
    the load."""
    spec = read_spec(config.model, config.mmproj)
    if config.task in ("embed", "score") or (config.task == "auto" and spec.task != "generate"):
        return PoolingEngine(config, spec=spec)
    return LLMEngine(config, spec)


def engine_config(model: str | Path, **kwargs: Any) -> EngineConfig:
    """A config from LLM-style keyword arguments (``dtype`` may be a name such as "bfloat16")."""
    return EngineConfig(model=str(model), **kwargs)


def resolve_speculative(spec: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
    """The checked speculative_config with its draft model (a built-in name or a path) resolved to a path."""
    from runlm.catalog import resolve_model

    checked = SpeculativeConfig.coerce(spec)
    if checked is None or checked.model is None:
        return checked
    return replace(checked, model=str(resolve_model(checked.model)))


def engine_from_model(model: str | Path, **kwargs: Any) -> EngineCoreType:
    """A built-in name, a .gguf file or a model directory -> the engine core for it."""
    from runlm.catalog import resolve_model  # names are the store's; the engine cores take paths

    if kwargs.get("speculative_config") is not None:
        kwargs["speculative_config"] = resolve_speculative(kwargs["speculative_config"])
    return engine_from_config(engine_config(resolve_model(str(model)), **kwargs))
