"""``runlm run`` through a running daemon: the same chat, streamed from /v1/chat/completions."""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any, TextIO

from runlm.cli.chat_turn import ChatOptions, Turn, TurnPrinter
from runlm.cli.client import CLIError, Daemon, error_message
from runlm.engine.types.sampling_params import SamplingParams


def data_url(image: bytes) -> str:
    """An image as a data: URL, its media type read from its first bytes."""
    kinds = {b"\x89PNG": "image/png", b"\xff\xd8\xff": "image/jpeg", b"GIF8": "image/gif", b"BM": "image/bmp"}
    media = next((m for magic, m in kinds.items() if image.startswith(magic)), None)
    if media is None:
        media = "image/webp" if image[8:12] == b"WEBP" else "application/octet-stream"
    return f"data:{media};base64,{base64.b64encode(image).decode()}"


@dataclass(slots=True)
class DaemonChat:
    daemon: Daemon
    model: str
    params: SamplingParams
    system: str | None
    options: ChatOptions = field(default_factory=ChatOptions)
    history: list[dict[str, Any]] = field(default_factory=list)
    last_turn: Turn | None = None
    context: int | None = None  # /set parameter num_ctx: the context the daemon loads the model with

    def __post_init__(self) -> None:
        if self.system:
            self.history.append({"role": "system", "content": self.system})

    @property
    def name(self) -> str:
        return self.model

    def _shown(self) -> dict[str, Any]:
        return self.daemon.call("POST", "/api/show", {"model": self.model})

    @property
    def template(self) -> str | None:
        return self._shown().get("template") or None

    def info(self) -> dict[str, Any]:
        shown = self._shown()
        d, arch = shown.get("details") or {}, (shown.get("model_info") or {}).get("general.architecture", "")
        return {"architecture": arch, "parameters": d.get("parameter_size"),
                "context length": (shown.get("model_info") or {}).get(f"{arch}.context_length"),
                "quantization": d.get("quantization_level")}

    def set_context(self, tokens: int) -> int:
        """The daemon loads the model with a context of at least ``tokens`` (Ollama's num_ctx), now and again
        before each answer should it have been unloaded meanwhile."""
        self.context = tokens
        self._load()
        ps = self.daemon.call("GET", "/api/ps").get("models") or []
        loaded = next((m.get("context_length") for m in ps if m.get("name") in (self.model, f"{self.model}:latest")
                       or m.get("model") in (self.model, f"{self.model}:latest")), None)
        return int(loaded or tokens)

    def _load(self) -> None:
        if self.context is not None:  # an empty /api/generate loads the model as its options ask
            self.daemon.call("POST", "/api/generate", {"model": self.model, "options": {"num_ctx": self.context},
                                                       "stream": False})

    def _body(self) -> dict:
        p = self.params
        body = {"model": self.model, "messages": self.history, "stream": True, "temperature": p.temperature,
                "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p, "repetition_penalty": p.repetition_penalty,
                "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
                "dry_multiplier": p.dry_multiplier, "dry_base": p.dry_base, "dry_allowed_length": p.dry_allowed_length,
                "dry_penalty_last_n": p.dry_penalty_last_n, "typical_p": p.typical_p, "repeat_last_n": p.penalty_last_n,
                "mirostat": p.mirostat, "mirostat_tau": p.mirostat_tau, "mirostat_eta": p.mirostat_eta,
                "max_tokens": p.max_tokens, "stream_options": {"include_usage": True}}
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop:
            body["stop"] = p.stop
        if self.options.format_json:
            body["response_format"] = {"type": "json_object"}
        if self.options.think is not None:
            body["chat_template_kwargs"] = self.options.template_kwargs()
        return body

    def reply(self, user_text: str, out: TextIO, images: list[bytes] | None = None) -> str:
        if images:  # OpenAI's image_url parts, the images inline as data: URLs
            parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
            self.history.append({"role": "user", "content": [*parts, {"type": "text", "text": user_text}]})
        else:
            self.history.append({"role": "user", "content": user_text})
        printer = TurnPrinter(out, Turn(), self.options.hide_thinking)
        try:
            self._load()
            with self.daemon.http.stream("POST", "/v1/chat/completions", json=self._body()) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise CLIError(error_message(resp))
                for line in resp.iter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    event = json.loads(line[5:])
                    if event.get("error"):
                        err = event["error"]
                        raise CLIError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
                    if event.get("usage"):
                        printer.turn.prompt_tokens = event["usage"].get("prompt_tokens", 0)
                        printer.turn.completion_tokens = event["usage"].get("completion_tokens", 0)
                    for choice in event.get("choices") or []:
                        delta = choice.get("delta") or {}
                        printer.push(delta.get("reasoning_content") or delta.get("reasoning") or "",
                                     delta.get("content") or "")
        except Exception:  # (an interrupted answer is popped by the interactive loop)
            self.history.pop()
            raise
        turn = self.last_turn = printer.finish(self.options.verbose)
        self.history.append(turn.message())
        return turn.text
