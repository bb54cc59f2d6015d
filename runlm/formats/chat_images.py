"""Images in chat messages: the parts that carry one are replaced by ``{"type": "image"}`` (what vision
models' chat templates render as their placeholder) and the images are returned in order, for the engine's
``multi_modal_data``.

The part shapes read here are the ones the Python API takes (vLLM's and transformers'):
``{"type": "image", "image": PIL image | bytes}``, ``{"type": "image_pil", "image_pil": ...}``,
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` (or the URL as a string) and the
Responses API's ``{"type": "input_image", "image_url": "data:..."}``. Only ``data:`` URLs are decoded here:
fetching a URL is the server's to allow (runlm serve-engine --allowed-media-domains).
"""
from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any

IMAGE_PARTS = ("image", "image_pil", "image_url", "input_image")


class ImagePartError(ValueError):
    """An image part that cannot be read (a client's mistake: a 400)."""


def decode_data_url(url: str, max_bytes: int | None = None) -> bytes:
    """The bytes of a ``data:[<media type>][;base64],<data>`` URL (base64 only)."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else url[:20]
        raise ImagePartError(f"image URLs with scheme {scheme!r} are not fetched; send the image inline as a "
                             f"data: URL (data:image/png;base64,...)")
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ImagePartError("an image data: URL must be base64-encoded (data:image/png;base64,...)")
    if max_bytes is not None and len(payload) > (max_bytes * 4) // 3 + 4:
        raise ImagePartError(f"the image is larger than {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImagePartError("the image data: URL is not valid base64") from None


def part_image(part: Mapping[str, Any]) -> Any:
    """What an image part holds: a PIL image, or the encoded bytes."""
    kind = part.get("type")
    value = part.get(kind) if kind in ("image", "image_pil") else part.get("image_url")
    if kind == "image" and value is None:
        return None  # an already-bare placeholder: its image comes with the request's multi_modal_data
    if isinstance(value, Mapping):
        value = value.get("url")
    if isinstance(value, str):
        return decode_data_url(value)
    if value is None:
        raise ImagePartError(f"an {kind!r} part without its image")
    return value


def take_images(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages for the chat template, the images in the order they appear)."""
    images: list[Any] = []
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list) or not any(isinstance(p, Mapping) and p.get("type") in IMAGE_PARTS
                                                    for p in content):
            out.append(dict(message))
            continue
        parts = []
        for p in content:
            if isinstance(p, Mapping) and p.get("type") in IMAGE_PARTS:
                image = part_image(p)
                if image is not None:
                    images.append(image)
                parts.append({"type": "image"})
            elif isinstance(p, Mapping) and p.get("type") == "input_text":
                parts.append({"type": "text", "text": p.get("text", "")})
            else:
                parts.append(p)
        out.append({**message, "content": parts})
    return out, images
