"""Decoding an image a client sent, with the limits checked before any pixel is allocated."""
from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL.Image import Image

MAX_IMAGE_BYTES = 20 << 20     # an encoded image (vLLM and llama.cpp's servers take a few tens of MB)
MAX_IMAGE_PIXELS = 40_000_000  # a decoded image (8k x 5k); Pillow's own bomb guard is 89M and only warns below 179M


class ImageError(ValueError):
    """An image the client sent that cannot be used: the message says why, for a 400."""


def open_image(data: Any, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_IMAGE_PIXELS) -> Image:
    """An RGB PIL image from encoded bytes or a PIL image; the size in bytes and in pixels is checked from the
    header, before the pixels are decoded."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    if isinstance(data, PILImage.Image):
        image = data
    else:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ImageError(f"an image is encoded bytes or a PIL image, not {type(data).__name__}")
        if len(data) > max_bytes:
            raise ImageError(f"the image is {len(data)} bytes; the limit is {max_bytes} bytes")
        try:
            image = PILImage.open(io.BytesIO(bytes(data)))
        except UnidentifiedImageError:
            raise ImageError("the data is not an image runlm can read (PNG, JPEG, WebP, GIF, BMP, ...)") from None
        except PILImage.DecompressionBombError as exc:  # Pillow's own guard, far above ours
            raise ImageError(f"the image is too large: {exc}") from None
    w, h = image.size
    if w < 1 or h < 1:
        raise ImageError(f"the image is {w}x{h} pixels")
    if w * h > max_pixels:
        raise ImageError(f"the image is {w}x{h} = {w * h} pixels; the limit is {max_pixels} pixels")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError(f"the image could not be decoded (truncated or corrupt): {exc}") from None
    return to_rgb(image)


def to_rgb(image: Image) -> Image:
    """RGB pixels as transformers' processors make them: a transparent image is laid over white first."""
    from PIL import Image as PILImage

    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    return PILImage.alpha_composite(PILImage.new("RGBA", rgba.size, (255, 255, 255)), rgba).convert("RGB")


def rescale_normalize(pixels: Any, rescale: float | None, mean: Any = None, std: Any = None) -> Any:
    """uint8 pixels [..., H, W, C] as float32, as transformers' image processors compute them: the rescale
    (1/255) in float64 and then float32, the normalisation per channel in float32. ``rescale`` None: no rescale;
    ``mean``/``std`` None: no normalisation."""
    import numpy as np

    out = (pixels.astype(np.float64) * rescale).astype(np.float32) if rescale is not None \
        else pixels.astype(np.float32)
    if mean is not None and std is not None:
        out = (out - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return out
