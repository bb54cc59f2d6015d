"""Backend modes and per-model configuration, with the JSON spellings of Docker Model Runner."""
from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from typing import Any

from runlm.formats.modelfile import PEFT_FILES, is_adapter
from runlm.store.blobs import check_digest

KEEP_ALIVE_DEFAULT = 300.0  # seconds
KEEP_ALIVE_FOREVER = -1.0
KEEP_ALIVE_MAX = 10 * 365 * 86400.0  # longer is forever: expiry times stay representable (ps, /api/ps)
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class ConfigError(ValueError):
    """A configuration value a person can fix; the message names the field."""


class BackendMode(str, enum.Enum):
    COMPLETION = "completion"
    EMBEDDING = "embedding"
    RERANKING = "reranking"
    IMAGE_GENERATION = "image-generation"

    @classmethod
    def parse(cls, text: str) -> BackendMode:
        try:
            return cls(text)
        except ValueError:
            raise ConfigError(f"unknown backend mode {text!r} (one of: {', '.join(m.value for m in cls)})") from None


def parse_keep_alive(value: Any) -> float:
    """'5m', '1h30m', '30s', 300, '0' (unload after the request), '-1' or any negative (never) -> seconds."""
    if isinstance(value, bool):
        raise ConfigError(f"keep_alive: {value!r} is not a duration")
    if isinstance(value, (int, float)):
        if math.isnan(value):
            raise ConfigError(f"keep_alive: {value!r} is not a duration")
        return KEEP_ALIVE_FOREVER if value < 0 or value > KEEP_ALIVE_MAX else float(value)
    text = str(value).strip()
    if re.fullmatch(r"-?\d+(\.\d+)?", text):
        return parse_keep_alive(float(text))
    negative = text.startswith("-")
    parts = _DURATION.findall(text.lstrip("-"))
    if not parts or "".join(n + u for n, u in parts) != text.lstrip("-"):
        raise ConfigError(f"keep_alive: {value!r} is not a duration (examples: '5m', '1h', '30s', '0', '-1')")
    seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    return KEEP_ALIVE_FOREVER if negative or seconds > KEEP_ALIVE_MAX else seconds


def format_keep_alive(seconds: float) -> str:
    if seconds < 0:
        return "-1"
    return f"{seconds:g}s"


@dataclass(slots=True)
class SpeculativeConfig:
    draft_model: str
    num_tokens: int = 5
    min_acceptance_rate: float = 0.0
    draft_model_path: str | None = None  # filled in by the loader from the store
    # the draft's fp32 K/V per token (the loader reads it from the store): the native engine keeps the draft's
    # K/V in the target's blocks, so the cache it is given must hold both
    draft_kv_bytes_per_token: int = 0


@dataclass(slots=True)
class BackendConfig:
    context_size: int | None = None
    runtime_flags: list[str] = field(default_factory=list)
    speculative: SpeculativeConfig | None = None
    keep_alive: float | None = None        # seconds; None = the default
    reasoning_budget: int | None = None    # llamacpp.reasoning_budget
    gpu_memory_utilization: float | None = None  # vllm.gpu_memory_utilization
    hf_overrides: dict[str, Any] | None = None   # vllm.hf_overrides
    loras: dict[str, dict[str, str]] = field(default_factory=dict)  # LoRA name -> {file: blob digest} (runner.lora)
    chat_template: str | None = None       # a chat template's text (Jinja or Go) instead of the model's
    lora_paths: dict[str, str] = field(default_factory=dict)        # LoRA name -> its files; filled in by the loader
    gpu: int | None = None  # of several GPUs, the one the loader placed it on (its process sees it alone)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BackendConfig:
        """Accepts DMR's spellings ('context-size', 'runtime-flags') and snake_case alike."""
        def pick(obj: dict, key: str) -> Any:
            return obj.get(key, obj.get(key.replace("_", "-")))

        cfg = cls()
        ctx = pick(data, "context_size")
        if ctx is not None:
            if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 16:
                raise ConfigError(f"context_size: {ctx!r} must be an integer of at least 16")
            cfg.context_size = ctx
        flags = pick(data, "runtime_flags")
        if flags is not None:
            if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
                raise ConfigError("runtime_flags: must be a list of strings")
            cfg.runtime_flags = list(flags)
        spec = data.get("speculative")
        if spec is not None:
            if not isinstance(spec, dict) or not isinstance(spec.get("draft_model"), str):
                raise ConfigError("speculative: needs {'draft_model': NAME, 'num_tokens': N, 'min_acceptance_rate': X}")
            n = spec.get("num_tokens", 5)
            rate = spec.get("min_acceptance_rate", 0.0)
            if not isinstance(n, int) or not 1 <= n <= 64:
                raise ConfigError(f"speculative.num_tokens: {n!r} must be an integer from 1 to 64")
            if not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
                raise ConfigError(f"speculative.min_acceptance_rate: {rate!r} must be between 0 and 1")
            cfg.speculative = SpeculativeConfig(spec["draft_model"], n, float(rate))
        if data.get("keep_alive") is not None:
            cfg.keep_alive = parse_keep_alive(data["keep_alive"])
        llamacpp = data.get("llamacpp") or {}
        budget = pick(llamacpp, "reasoning_budget")
        if budget is not None:
            if not isinstance(budget, int) or budget < -1:
                raise ConfigError(f"llamacpp.reasoning_budget: {budget!r} must be -1 (unlimited), 0 or more")
            cfg.reasoning_budget = budget
        vllm = data.get("vllm") or {}
        util = pick(vllm, "gpu_memory_utilization")
        if util is not None:
            if not isinstance(util, (int, float)) or not 0 < util <= 1:
                raise ConfigError(f"vllm.gpu_memory_utilization: {util!r} must be in (0, 1]")
            cfg.gpu_memory_utilization = float(util)
        overrides = pick(vllm, "hf_overrides")
        if overrides is not None:
            if not isinstance(overrides, dict):
                raise ConfigError("vllm.hf_overrides: must be a JSON object")
            cfg.hf_overrides = overrides
        if data.get("loras") is not None:
            cfg.loras = parse_loras(data["loras"])
        template = pick(data, "chat_template")
        if template is not None:
            cfg.chat_template = _checked_template(template)
        return cfg

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.context_size is not None:
            out["context-size"] = self.context_size
        if self.runtime_flags:
            out["runtime-flags"] = self.runtime_flags
        if self.speculative:
            s = self.speculative
            out["speculative"] = {"draft_model": s.draft_model, "num_tokens": s.num_tokens,
                                  "min_acceptance_rate": s.min_acceptance_rate}
        if self.keep_alive is not None:
            out["keep_alive"] = format_keep_alive(self.keep_alive)
        if self.reasoning_budget is not None:
            out["llamacpp"] = {"reasoning-budget": self.reasoning_budget}
        if self.gpu_memory_utilization is not None or self.hf_overrides:
            out["vllm"] = {k: v for k, v in (("gpu-memory-utilization", self.gpu_memory_utilization),
                                             ("hf-overrides", self.hf_overrides)) if v is not None}
        if self.loras:
            out["loras"] = self.loras
        if self.chat_template is not None:
            out["chat-template"] = self.chat_template
        return out


def _checked_template(template: Any) -> str:
    """A configured chat template: text (never a path: the daemon reads no file a client names), within the size a
    model's own may have, that parses (Jinja or Ollama's Go)."""
    from runlm.formats.template_render import template_problem
    from runlm.formats.tokenizer import MAX_TEMPLATE_FILE

    if not isinstance(template, str) or not template:
        raise ConfigError(f"chat_template: the template's text, 1 to {MAX_TEMPLATE_FILE} characters")
    if why := template_problem(template, MAX_TEMPLATE_FILE):
        raise ConfigError(f"chat_template: {why}")
    return template


# LoRA adapters in a configuration (runlm/runner/lora.py imports and serves them)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _check_files(name: str, files: Any) -> dict[str, str]:
    if not isinstance(files, dict) or not files:
        raise ConfigError(f"loras.{name}: must map file names to blob digests")
    if not is_adapter(set(files)):
        raise ConfigError(f"loras.{name}: files must be {' and '.join(PEFT_FILES)}, or one .gguf file")
    for file, digest in files.items():
        plain = isinstance(file, str) and "/" not in file and "\\" not in file and not file.startswith(".")
        if not plain or not isinstance(digest, str):
            raise ConfigError(f"loras.{name}: {file!r} is not a plain file name with a digest")
        try:
            check_digest(digest)
        except ValueError as exc:
            raise ConfigError(f"loras.{name}.{file}: {exc}") from None
    return dict(files)


def parse_loras(data: Any) -> dict[str, dict[str, str]]:
    """The ``loras`` field of a configuration: {NAME: {file name: "sha256:<hex>"}}."""
    if not isinstance(data, dict):
        raise ConfigError("loras: must be an object {NAME: {file name: digest}}")
    out = {}
    for name, files in data.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name) or ":" in name:
            raise ConfigError(f"loras: {name!r} is not a valid adapter name (letters, digits, '.', '_', '-')")
        out[name] = _check_files(name, files)
    return out
