"""Ollama's ``options``: every one honoured or refused by name, none silently dropped.

Three kinds: sampling options become the OpenAI request's fields (the backend's sampler has each of them);
load options (``num_ctx``, ``num_batch``, ``num_thread``) choose how the model's runner is loaded — a runner
loaded otherwise is reloaded, as Ollama reloads; and options about the machine that runlm does one way only
(it always maps the model file, never locks it...) are accepted at the value that describes what it does and
refused at any other.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from runlm.formats.sampling_defaults import MIN_CONTEXT, OLLAMA_FIXED
from runlm.runner.backends.native import flag_value
from runlm.runner.config import BackendConfig
from runlm.runner.errors import BadRequest

# Ollama option -> the OpenAI (or vLLM / llama-server extension) field the backends read
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "stop": "stop", "num_predict": "max_tokens", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty", "repeat_penalty": "repetition_penalty",
            "repeat_last_n": "repeat_last_n", "typical_p": "typical_p", "mirostat": "mirostat",
            "mirostat_tau": "mirostat_tau", "mirostat_eta": "mirostat_eta", "num_keep": "n_keep"}
LOAD = ("num_ctx", "num_batch", "num_thread")
REFUSED = {"num_gpu": "choose the device with `runlm configure MODEL --runtime-flags --device cpu|cuda`",
           "main_gpu": "choose the device with `runlm configure MODEL --runtime-flags --device cuda:N`"}


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """What a request asks of the runner it runs on (None: anything)."""
    context: int | None = None
    batch: int | None = None
    threads: int | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.context, self.batch, self.threads))

    def apply(self, config: BackendConfig) -> BackendConfig:
        """``config`` with these options in place of its own."""
        flags = list(config.runtime_flags)
        for flag, value in (("--max-num-batched-tokens", self.batch), ("--threads", self.threads)):
            if value is not None:
                flags = _without(flags, flag) + [flag, str(value)]
        return replace(config, context_size=self.context if self.context is not None else config.context_size,
                       runtime_flags=flags)

    def met_by(self, context: int, max_context: int, config: BackendConfig) -> bool:
        """Whether a runner loaded with ``config`` (its context ``context``; the model's own ``max_context``)
        serves this request: a context at least the one asked (a larger one is kept: a context never shrinks
        under the requests running in it), the same batch and threads."""
        if self.context is not None and context < min(self.context, max_context):
            return False
        for flag, value in (("--max-num-batched-tokens", self.batch), ("--threads", self.threads)):
            if value is not None and flag_value(config.runtime_flags, flag) != str(value):
                return False
        return True


def _without(flags: list[str], name: str) -> list[str]:
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f == name:
            skip = True
        elif not f.startswith(name + "="):
            out.append(f)
    return out


def _positive_int(key: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise BadRequest(f"option {key!r} must be an integer of at least {low}, got {value!r}", param=f"options.{key}")
    return value


def ollama_options(body: dict) -> tuple[dict[str, Any], LoadOptions]:
    """The request's ``options`` as (OpenAI sampling fields, load options); an option runlm cannot honour is a
    400 naming it."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'options' must be an object", param="options")
    fields: dict[str, Any] = {}
    load: dict[str, int] = {}
    for key, value in options.items():
        if key in SAMPLING:
            if key == "num_predict" and isinstance(value, int) and value < 0:
                continue  # -1: until the model stops (or the context is full)
            if key == "mirostat" and value == 0:
                continue
            fields[SAMPLING[key]] = value
        elif key in LOAD:
            load[key] = _positive_int(key, value, MIN_CONTEXT if key == "num_ctx" else 1)
        elif key in OLLAMA_FIXED:
            want, why = OLLAMA_FIXED[key]
            if value != want:
                raise BadRequest(f"option {key!r} = {value!r} is not supported: {why}", param=f"options.{key}")
        elif key in REFUSED:
            raise BadRequest(f"option {key!r} is not supported: {REFUSED[key]}", param=f"options.{key}")
        else:
            raise BadRequest(f"unknown option {key!r}", param=f"options.{key}")
    return fields, LoadOptions(load.get("num_ctx"), load.get("num_batch"), load.get("num_thread"))
