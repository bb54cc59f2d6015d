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

import re
from collections.abc import Mapping, Sequence
from typing import Any

from runlm.formats.template_process import render_isolated
from runlm.formats.template_render import ChatTemplateError, ChatTemplateLimitError, render_in_process

__all__ = ["CHATML_TEMPLATE", "ChatTemplateError", "ChatTemplateLimitError", "render_chat", "render_in_process"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# a template that loops over a message's content parts and never asks whether the content is a string (llava-hf's,
# for one) reads only part lists: its messages keep their parts and a string becomes one text part (vLLM's
# "openai" content format); every other template gets strings
_LOOPS_OVER_PARTS = re.compile(r"for\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]|\.content\b)")
_ASKS_STRING = re.compile(r"content['\"]?\]?\s+is\s+(?:not\s+)?string")


def _parts_only(template: str | None) -> bool:
    return bool(template) and bool(_LOOPS_OVER_PARTS.search(template or "")) and not _ASKS_STRING.search(template or "")


def _normalise(message: Mapping[str, Any], parts: bool = False) -> dict[str, Any]:
    """Content-part lists of plain text become one string (most templates expect a str); with ``parts``, strings
    become one text part instead."""
    out = dict(message)
    content = out.get("content")
    if parts:
        if isinstance(content, str):
            out["content"] = [{"type": "text", "text": content}]
        elif content is None:
            out["content"] = []
    elif isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
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
    source = template if template else CHATML_TEMPLATE
    parts = _parts_only(template)
    context = dict(messages=[_normalise(m, parts) for m in messages], add_generation_prompt=add_generation_prompt,
                   bos_token=bos_token or "", eos_token=eos_token or "", tools=tools, **extra)
    return render_isolated(source, context)
