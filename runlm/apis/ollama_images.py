"""Ollama's ``images`` (base64 strings on an ``/api/chat`` message or an ``/api/generate`` request) as the OpenAI
chat content the daemon proxies to a backend: the images first, as ``image_url`` parts with data: URLs (so part j is
``images[j]``, and a backend's error naming ``content[j]`` names that image), then the text. The backend decodes
and checks them (runlm/server/media.py); here only the shape is checked."""
from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any

from runlm.apis.source import ProtocolError

# how a caller's 400 is made: (message, param) -> the exception to raise (the daemon passes its BadRequest)
Refuse = Callable[[str, str], Exception]


def _protocol_error(message: str, param: str) -> Exception:
    return ProtocolError(400, message, param, "invalid_image")

# the first bytes of the formats a client is likely to send, for the data: URL's media type
_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"), (b"BM", "image/bmp"))


def media_type(head: bytes) -> str:
    """The image type the first bytes say (the backend reads the bytes themselves; this only labels the URL)."""
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    return "image/webp" if head[8:12] == b"WEBP" else "application/octet-stream"


def image_url(image: Any, where: str, refuse: Refuse = _protocol_error) -> str:
    """One Ollama image (base64, or already a data: URL) as a data: URL; anything else is a 400 naming it."""
    if not isinstance(image, str) or not image:
        raise refuse(f"{where} must be an image as a base64 string", where)
    if image.startswith("data:"):
        return image
    try:
        head = base64.b64decode(image[:24], validate=True)
    except (binascii.Error, ValueError):
        raise refuse(f"{where} is not valid base64 (Ollama's images are base64-encoded files)", where) from None
    return f"data:{media_type(head)};base64,{image}"


def ollama_content(text: Any, images: Any, where: str, refuse: Refuse = _protocol_error) -> str | list[dict[str, Any]]:
    """A message's content with its images: the text alone when there are none, else the image parts, then the
    text. ``where`` names the images field (``messages[0].images``, ``images``)."""
    if not images:
        return text if isinstance(text, str) else ""
    if not isinstance(images, list):
        raise refuse(f"{where} must be a list of base64 strings", where)
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": image_url(img, f"{where}[{j}]", refuse)}}
                                   for j, img in enumerate(images)]
    if isinstance(text, str) and text:
        parts.append({"type": "text", "text": text})
    return parts
