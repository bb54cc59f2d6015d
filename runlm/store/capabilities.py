"""What a stored model can do, as Ollama's ``/api/show`` says it: ``capabilities`` and the inputs it accepts.

Ollama lists ``completion`` (or ``embedding``), ``vision`` for a model with a projector or a vision tower,
``tools`` for a chat template that takes tools, and ``thinking`` for one that writes thinking tags, in that
order. runlm adds its own kinds where a model is none of those (``reranking``, ``image-generation``).
Everything here is read from the store's record (headers read at pull time) and the model's files list.
"""
from __future__ import annotations

from runlm.store.refs import StoredModel
from runlm.tools.prompt import template_knows_tools
from runlm.tools.reasoning import parser_for_template

ORDER = ("completion", "embedding", "reranking", "image-generation", "vision", "tools", "thinking")


def capabilities(model: StoredModel) -> list[str]:
    info = model.info
    caps = list(dict.fromkeys(info.capabilities))
    if "completion" in caps:
        if model.mmproj is not None:
            caps.append("vision")
        if template_knows_tools(info.template):
            caps.append("tools")
        if parser_for_template(info.template) is not None:
            caps.append("thinking")
    caps = list(dict.fromkeys(caps))
    return sorted(caps, key=lambda c: ORDER.index(c) if c in ORDER else len(ORDER))


def input_modalities(model: StoredModel) -> list[str]:
    """What a request may give the model: text, and images for a vision model."""
    return ["text", "image"] if "vision" in capabilities(model) else ["text"]
