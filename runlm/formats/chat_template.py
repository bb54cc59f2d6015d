"""Chat templates: the model's own Jinja template, rendered in a sandbox.

The variables and helpers are the ones transformers' ``apply_chat_template``
provides (``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
``tools``, ``raise_exception``, ``strftime_now``, a ``tojson`` that does not
escape HTML), so templates written for Hugging Face models render the same.

Fallback for models with no template: ChatML (``<|im_start|>role\\n...<|im_end|>``),
the format most instruction-tuned small models use; it is also what runlm renders
for base models, where any format is a guess.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext

from runlm.formats.template_limits import RENDER_SECONDS, BoundedSandbox, bounded_output

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


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


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def _normalise(message: Mapping[str, Any]) -> dict[str, Any]:
    """Content-part lists of plain text become one string: most templates expect a str."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        out["content"] = "".join(str(p.get("text", "")) for p in content)
    elif content is None:
        out["content"] = ""
    return out


def render_chat(messages: Sequence[Mapping[str, Any]], template: str | None, *,
                add_generation_prompt: bool = True, bos_token: str | None = None,
                eos_token: str | None = None, tools: list[dict] | None = None,
                **extra: Any) -> str:
    """Render ``messages`` with ``template`` (ChatML when None) to the prompt text. ``tools`` reach the
    template as given (runlm.tools.prompt.render_tool_chat first fits tool turns to the template).
    Time and size are bounded (runlm/formats/template_limits.py), and the render runs in a worker process
    with a memory and CPU limit no template can escape (runlm/formats/template_process.py)."""
    from runlm.formats.template_process import render_isolated

    source = template if template else CHATML_TEMPLATE
    context = dict(messages=[_normalise(m) for m in messages], add_generation_prompt=add_generation_prompt,
                   bos_token=bos_token or "", eos_token=eos_token or "", tools=tools, **extra)
    return render_isolated(source, context)


def render_in_process(source: str, context: dict[str, Any]) -> str:
    """The render itself, in this process: what a template worker runs."""
    try:
        compiled = _compile(source)
        return bounded_output(compiled.generate(**context), RENDER_SECONDS)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
