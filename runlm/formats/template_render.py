"""A chat template rendered in this process, in jinja's sandbox with every string-growing operation bounded
(runlm/formats/template_limits.py): what a template worker (runlm/formats/template_process.py) runs. The
variables and helpers are transformers' ``apply_chat_template``'s."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext

from runlm.formats.go_template import GoTemplateError, looks_like_go
from runlm.formats.ollama_template import compiled, render_ollama
from runlm.formats.template_limits import RENDER_SECONDS, BoundedSandbox, bounded_output

# what render_chat itself passes a template; the rest are chat_template_kwargs
_OWN_KEYS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class ChatTemplateError(ValueError):
    """The template failed to render (or raised on purpose through raise_exception)."""


class ChatTemplateLimitError(ChatTemplateError):
    """The template ran past a limit (size, time, memory, CPU): the template is at fault, not the messages."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing dunder names so templates cannot reach interpreter internals."""

    def __setitem__(self, name: str, value: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")
        super().__setitem__(name, value)


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks the assistant's tokens for training
    masks): rendered as its body."""
    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def check_template(source: str) -> None:
    """Compile ``source`` as a chat template (a server's own, read at start; Jinja, or Ollama's Go): jinja2's
    TemplateSyntaxError or a GoTemplateError (a ValueError) where it is not one."""
    if looks_like_go(source):
        compiled(source)
    else:
        _compile(source)


def template_problem(source: str, limit: int) -> str | None:
    """Why ``source`` cannot be a chat template (longer than ``limit`` characters, or it does not parse as Jinja or
    Ollama's Go); None where it can."""
    if len(source) > limit:
        return f"is longer than {limit} characters"
    try:
        check_template(source)
    except Exception as exc:  # jinja2's TemplateSyntaxError, a GoTemplateError, or the sandbox's limits
        return f"does not parse: {exc}"
    return None


def render_in_process(source: str, context: dict[str, Any]) -> str:
    """The render itself, in this process: what a template worker runs. An Ollama (Go) template gets Ollama's
    values (runlm/formats/ollama_template.py) from the same messages and tools."""
    try:
        if looks_like_go(source):
            extra = {k: v for k, v in context.items() if k not in _OWN_KEYS}
            return bounded_output(render_ollama(source, context["messages"], context.get("tools"), extra),
                                  RENDER_SECONDS)
        return bounded_output(_compile(source).generate(**context), RENDER_SECONDS)
    except (jinja2.exceptions.TemplateError, GoTemplateError) as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
