"""A prompt's images: decoded, checked against the model and the limit, and placed (their placeholders expanded)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from runlm.engine.types.errors import PromptError
from runlm.models.vision.images import ImageError, open_image

if TYPE_CHECKING:
    from runlm.models.vision import VisionModel
    from runlm.models.vision.inputs import MultiModalPrompt


def prompt_images(prompt: Any, ids: list[int], vision: VisionModel | None, image_limit: int,
                  model_name: str) -> MultiModalPrompt | None:
    """The images of ``prompt`` (its ``multi_modal_data``) placed in ``ids``; None without any."""
    data = prompt.get("multi_modal_data") if isinstance(prompt, Mapping) else None
    if not data:
        return None
    if not isinstance(data, Mapping):
        raise PromptError("multi_modal_data is a mapping such as {'image': [image, ...]}")
    unknown = [k for k in data if k != "image"]
    if unknown:
        raise PromptError(f"runlm takes images only, not {unknown[0]!r} inputs")
    images = data.get("image")
    images = list(images) if isinstance(images, list | tuple) else [] if images is None else [images]
    if not images:
        return None
    if vision is None:
        raise PromptError(f"the model {model_name} does not accept images (it is a text-only model)")
    if len(images) > image_limit:
        raise PromptError(f"the prompt has {len(images)} images; at most {image_limit} are allowed per prompt "
                          f"(--limit-mm-per-prompt)")
    try:
        return vision.processor.process(ids, [open_image(i) for i in images])
    except ImageError as exc:
        raise PromptError(str(exc)) from None
