"""POST /v1/images/generations: OpenAI's request fields plus diffusers' own, checked before any work.

OpenAI's fields: ``prompt``, ``n``, ``size`` ('WxH' or 'auto'), ``response_format`` (only
``b64_json``: runlm keeps no files to link to), ``output_format`` (png, jpeg, webp) and ``stream``;
the rest of OpenAI's (quality, style, background, user, ...) mean nothing to a diffusion pipeline
and are ignored. Diffusers' own: ``seed``, ``steps``, ``guidance_scale``, ``negative_prompt``,
``scheduler``. What the pipeline decides (its default size, step count and schedulers) is checked
against the loaded pipeline in ``ImageGenerator.resolve``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

MAX_IMAGES = 10          # OpenAI's limit on n
MAX_SIDE = 2048          # pixels; a 2048x2048 SDXL image already needs several GB of activations
SIDE_MULTIPLE = 8        # what every latent diffusion model's VAE needs at least
MAX_STEPS = 200
MAX_GUIDANCE = 100.0
MAX_PROMPT_CHARS = 32000  # gpt-image-1's limit
MAX_SEED = 2**63 - 1      # torch.Generator.manual_seed takes a signed 64-bit seed
OUTPUT_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


class ImageRequestError(ValueError):
    """A request field a person can fix; answered as a 400 naming ``param``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True, frozen=True)
class ImageRequest:
    prompt: str
    n: int = 1
    width: int | None = None   # None: the pipeline's default size
    height: int | None = None
    seed: int | None = None    # None: a random one, reported in the answer
    steps: int | None = None   # None: the pipeline's default
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    scheduler: str | None = None
    output_format: str = "png"
    stream: bool = False

    @property
    def size(self) -> str | None:
        return f"{self.width}x{self.height}" if self.width else None


def parse_size(value: Any, max_side: int = MAX_SIDE) -> tuple[int, int] | None:
    """'1024x768' -> (1024, 768); 'auto' or None -> None (the pipeline's default)."""
    if value is None or value == "auto":
        return None
    m = re.fullmatch(r"(\d{1,5})x(\d{1,5})", value) if isinstance(value, str) else None
    if m is None:
        raise ImageRequestError(f"size {value!r} is not 'WIDTHxHEIGHT' (for example '512x512') or 'auto'", "size")
    width, height = int(m.group(1)), int(m.group(2))
    for side in (width, height):
        if side % SIDE_MULTIPLE or not SIDE_MULTIPLE <= side <= max_side:
            raise ImageRequestError(f"size {value!r}: width and height must be multiples of {SIDE_MULTIPLE} from "
                                    f"{SIDE_MULTIPLE} to {max_side}", "size")
    return width, height


def _int(body: dict, key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ImageRequestError(f"{key} must be an integer from {low} to {high} (got {value!r})", key)
    return value


def _text(body: dict, key: str, required: bool = False) -> str | None:
    value = body.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value.strip()):
        raise ImageRequestError(f"{key} must be a{' non-empty' if required else ''} string", key)
    if len(value) > MAX_PROMPT_CHARS:
        raise ImageRequestError(f"{key} is longer than {MAX_PROMPT_CHARS} characters", key)
    return value


def parse_request(body: Any, max_side: int = MAX_SIDE) -> ImageRequest:
    if not isinstance(body, dict):
        raise ImageRequestError("the request body must be a JSON object")
    prompt = _text(body, "prompt", required=True)
    assert prompt is not None
    n = _int(body, "n", 1, MAX_IMAGES)
    size = parse_size(body.get("size"), max_side)
    if body.get("response_format") not in (None, "b64_json"):
        raise ImageRequestError(f"response_format {body['response_format']!r} is not supported: images come back "
                                f"inline as 'b64_json' (runlm keeps no files to link to)", "response_format")
    output_format = body.get("output_format") or "png"
    if output_format not in OUTPUT_FORMATS:
        raise ImageRequestError(f"output_format must be one of {', '.join(OUTPUT_FORMATS)}", "output_format")
    guidance = body.get("guidance_scale")
    if guidance is not None and (isinstance(guidance, bool) or not isinstance(guidance, (int, float))
                                 or not math.isfinite(guidance) or not 0 <= guidance <= MAX_GUIDANCE):
        raise ImageRequestError(f"guidance_scale must be a number from 0 to {MAX_GUIDANCE:g}", "guidance_scale")
    scheduler = _text(body, "scheduler")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ImageRequestError("stream must be true or false", "stream")
    return ImageRequest(prompt=prompt, n=n or 1, width=size[0] if size else None, height=size[1] if size else None,
                        seed=_int(body, "seed", 0, MAX_SEED), steps=_int(body, "steps", 1, MAX_STEPS),
                        guidance_scale=float(guidance) if guidance is not None else None,
                        negative_prompt=_text(body, "negative_prompt"), scheduler=scheduler,
                        output_format=output_format, stream=stream)
