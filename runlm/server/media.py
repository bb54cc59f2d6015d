"""Images in chat requests: each image part read (a ``data:`` URL, or an ``http(s)`` URL from a host the server
was told to fetch from), decoded and checked on a worker thread, and replaced by ``{"type": "image"}`` (what vision
models' chat templates render as their placeholder); the images go to the engine in order: decoded for an engine in
this process (so it does not decode them again), as the encoded bytes for replicas in other processes.

Everything a client can get wrong is a 400 naming the part, decided here before anything reaches the engine: an
image sent to a text-only model, too many images (--limit-mm-per-prompt), a URL scheme or host that is not
fetched, bytes that are not an image or are truncated, an image too large in bytes or pixels.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

from runlm.formats.chat_images import ImagePartError, decode_data_url
from runlm.models.vision.images import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, ImageError, open_image
from runlm.server.errors import bad_request

# the part types that carry an image: OpenAI chat's, the Responses API's (translated to image_url by runlm/apis),
# and the Python API's bare placeholder
IMAGE_PARTS = ("image_url", "input_image", "image")
# other media OpenAI and vLLM define, which runlm's models do not take
OTHER_MEDIA = ("input_audio", "audio_url", "video_url", "file", "input_file")
DEFAULT_IMAGE_LIMIT = 16
MAX_REDIRECTS = 3


@dataclass(frozen=True, slots=True)
class CheckedImage:
    data: bytes   # as the client sent it (what travels to another process)
    image: Any    # decoded, RGB (a PIL image: what an engine in this process takes as it is)


@dataclass(frozen=True, slots=True)
class MediaSettings:
    """How a server takes images: which hosts it fetches ``http(s)`` image URLs from (none by default; a
    leading ``*.`` allows the subdomains), how large an image may be, how long a fetch may take, and how many
    images one prompt may hold."""
    allowed_domains: tuple[str, ...] = ()
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    fetch_timeout: float = 10.0
    limit_per_prompt: int = DEFAULT_IMAGE_LIMIT

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        for domain in self.allowed_domains:
            domain = domain.lower().rstrip(".")
            if domain.startswith("*.") and host.endswith(domain[1:]):
                return True
            if host == domain:
                return True
        return False


def parse_mm_limit(value: str | None) -> int:
    """--limit-mm-per-prompt as vLLM takes it: ``image=4``, JSON ``{"image": 4}``, or a bare number."""
    import json

    if value is None or value == "":
        return DEFAULT_IMAGE_LIMIT
    text = value.strip()
    found: Any
    if text.startswith("{"):
        try:
            found = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--limit-mm-per-prompt is not JSON: {exc}") from None
    elif "=" in text:
        found = {key.strip(): number for key, _, number in (item.partition("=") for item in text.split(","))}
    else:
        found = {"image": text}
    if not isinstance(found, dict):
        raise ValueError("--limit-mm-per-prompt takes image=N or {\"image\": N}")
    unknown = [k for k in found if k != "image"]
    if unknown:
        raise ValueError(f"--limit-mm-per-prompt: runlm takes images only, not {unknown[0]!r}")
    try:
        limit = int(str(found.get("image", DEFAULT_IMAGE_LIMIT)).strip())
    except ValueError:
        raise ValueError("--limit-mm-per-prompt: the number of images must be a whole number") from None
    if limit < 0:
        raise ValueError("--limit-mm-per-prompt: the number of images must be 0 or more")
    return limit


def is_image_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in IMAGE_PARTS


def _parts(message: Mapping[str, Any]) -> list[Any]:
    content = message.get("content")
    return content if isinstance(content, list) else []


def _url_of(part: Mapping[str, Any], where: str) -> str:
    kind = part["type"]
    value = part.get("image_url") if kind in ("image_url", "input_image") else part.get("image")
    if isinstance(value, Mapping):
        value = value.get("url")
    if kind == "input_image" and value is None and part.get("file_id") is not None:
        raise bad_request(f"{where}: input_image by file_id is not supported (there is no files API); send "
                          f"image_url as a data: URL", where, "invalid_image")
    if not isinstance(value, str) or not value:
        field = f"{where}.image_url.url" if kind == "image_url" else f"{where}.image_url"
        raise bad_request(f"{where}: an {kind} part needs the image as a URL string (data:image/png;base64,...)",
                          field if kind != "image" else where, "invalid_image")
    return value


async def fetch_image(url: str, media: MediaSettings, where: str) -> bytes:
    """The bytes at an ``http(s)`` URL on an allowed host: at most ``max_bytes``, within ``fetch_timeout``;
    a redirect is followed only to another allowed host."""
    import httpx

    async def get(client: httpx.AsyncClient, url: str) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            host = urlsplit(url).hostname or ""
            if urlsplit(url).scheme not in ("http", "https") or not media.allows(host):
                raise bad_request(f"{where}: the image URL redirects to {host or url!r}, which this server does "
                                  f"not fetch from", where, "image_url_not_allowed")
            async with client.stream("GET", url) as resp:
                if resp.is_redirect and "location" in resp.headers:
                    url = urljoin(url, resp.headers["location"])
                    continue
                if resp.status_code != 200:
                    raise bad_request(f"{where}: fetching the image URL answered HTTP {resp.status_code}", where,
                                      "image_fetch_failed")
                size = resp.headers.get("content-length")
                if size is not None and size.isdigit() and int(size) > media.max_bytes:
                    raise bad_request(f"{where}: the image is {size} bytes; the limit is {media.max_bytes} bytes",
                                      where, "image_too_large")
                data = bytearray()
                async for chunk in resp.aiter_bytes():
                    data += chunk
                    if len(data) > media.max_bytes:
                        raise bad_request(f"{where}: the image is more than {media.max_bytes} bytes; the limit is "
                                          f"{media.max_bytes} bytes", where, "image_too_large")
                return bytes(data)
        raise bad_request(f"{where}: the image URL redirects more than {MAX_REDIRECTS} times", where,
                          "image_fetch_failed")

    try:
        async with httpx.AsyncClient(follow_redirects=False, timeout=media.fetch_timeout, trust_env=False) as client:
            return await asyncio.wait_for(get(client, url), media.fetch_timeout)
    except TimeoutError:
        raise bad_request(f"{where}: fetching the image URL took longer than {media.fetch_timeout:g} s", where,
                          "image_fetch_failed") from None
    except httpx.HTTPError as exc:
        raise bad_request(f"{where}: fetching the image URL failed: {type(exc).__name__}: {exc}", where,
                          "image_fetch_failed") from None


async def image_bytes(url: str, media: MediaSettings, where: str) -> bytes:
    """The encoded image a part's URL carries (decoded or fetched), or a 400."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        try:
            return decode_data_url(url, media.max_bytes)
        except ImagePartError as exc:
            code = "image_too_large" if "larger than" in str(exc) else "invalid_image"
            raise bad_request(f"{where}: {exc}", where, code) from None
    if scheme in ("http", "https"):
        host = urlsplit(url).hostname or ""
        if not media.allowed_domains:
            raise bad_request(f"{where}: this server does not fetch image URLs; send the image inline as a data: "
                              f"URL (data:image/png;base64,...), or start the server with --allowed-media-domains "
                              f"HOST", where, "image_url_not_allowed")
        if not media.allows(host):
            raise bad_request(f"{where}: this server does not fetch images from {host!r} (--allowed-media-domains "
                              f"allows {', '.join(media.allowed_domains)})", where, "image_url_not_allowed")
        return await fetch_image(url, media, where)
    shown = scheme or url[:20]
    raise bad_request(f"{where}: image URLs with scheme {shown!r} are not accepted; send a data: URL "
                      f"(data:image/png;base64,...)", where, "image_url_not_allowed")


def check_image(data: bytes, media: MediaSettings, where: str) -> Any:
    """The decoded image (decode it off the event loop): not an image, truncated, too many bytes or pixels -> 400."""
    try:
        return open_image(data, media.max_bytes, media.max_pixels)
    except ImageError as exc:
        text = str(exc)
        code = "image_too_large" if "the limit is" in text else "invalid_image"
        raise bad_request(f"{where}: {text}", where, code) from None


async def take_images(messages: Sequence[Mapping[str, Any]], media: MediaSettings, modalities: Sequence[str],
                      model: str, param: str = "messages") -> tuple[list[dict[str, Any]], list[CheckedImage]]:
    """(the messages with each image part replaced by ``{"type": "image"}``, the images' bytes in order).
    ``param`` names the request's field in errors (``messages``; a translated API maps it to its own)."""
    found = [f"{param}[{i}].content[{j}]" for i, m in enumerate(messages) for j, p in enumerate(_parts(m))
             if is_image_part(p)]
    if not found:
        return [dict(m) for m in messages], []
    count, first = len(found), found[0]
    if "image" not in modalities:
        name = f"the model {model!r}" if model else "this model"
        raise bad_request(f"{name} does not accept images (image inputs are not supported by a text-only model)",
                          first, "image_input_not_supported")
    if count > media.limit_per_prompt:
        raise bad_request(f"the request has {count} images; at most {media.limit_per_prompt} are allowed per "
                          f"prompt (--limit-mm-per-prompt)", first, "too_many_images")
    out: list[dict[str, Any]] = []
    images: list[CheckedImage] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list) or not any(is_image_part(p) for p in content):
            out.append(dict(message))
            continue
        parts: list[Any] = []
        for j, part in enumerate(content):
            if not is_image_part(part):
                parts.append(part)
                continue
            where = f"{param}[{i}].content[{j}]"
            data = await image_bytes(_url_of(part, where), media, where)
            images.append(CheckedImage(data, await asyncio.to_thread(check_image, data, media, where)))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images
