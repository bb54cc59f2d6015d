"""Images in requests without a model: each API's parts as chat's ``image_url`` parts, the server's reading of them
(the ``{"type": "image"}`` placeholders, the bytes in order), its limits and refusals, fetching under
--allowed-media-domains (size, time, redirects), and --limit-mm-per-prompt's forms. Fast: no engine."""
from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from runlm.apis import anthropic_request, responses_request
from runlm.apis.ollama_images import ollama_content
from runlm.apis.responses_items import input_items
from runlm.apis.source import CLIENT_PATH, ProtocolError, image_paths, renamed
from runlm.server.errors import APIError
from runlm.server.media import MediaSettings, fetch_image, parse_mm_limit, take_images
from runlm.server.prompts import normalise_messages
from tests.fixtures.vlm import png_bytes, test_image

PNG = png_bytes(test_image(32, 24))
URL = f"data:image/png;base64,{base64.b64encode(PNG).decode()}"
VISION = ("text", "image")


def run(coro):
    return asyncio.run(coro)


def refusal(coro) -> APIError:
    with pytest.raises(APIError) as err:
        run(coro)
    assert err.value.status == 400
    return err.value


def test_images_become_placeholders_in_order() -> None:
    other = png_bytes(test_image(32, 24, seed=5))
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Compare"},
                                             {"type": "image_url", "image_url": {"url": URL, "detail": "low"}},
                                             {"type": "input_image", "image_url": URL.replace(
                                                 base64.b64encode(PNG).decode(), base64.b64encode(other).decode())}]}]
    out, images = run(take_images(messages, MediaSettings(), VISION, "m"))
    assert [i.data for i in images] == [PNG, other] and [i.image.size for i in images] == [(32, 24)] * 2
    assert out[0] == messages[0]
    assert out[1]["content"] == [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"}]
    text_only = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert run(take_images(text_only, MediaSettings(), ("text",), "m")) == (text_only, [])  # unchanged


def test_refusals_name_the_part() -> None:
    ask = lambda url: [{"role": "user", "content": ["x" and {"type": "text", "text": "x"},  # noqa: E731
                                                    {"type": "image_url", "image_url": {"url": url}}]}]
    err = refusal(take_images(ask(URL), MediaSettings(), ("text",), "smollm2"))
    assert err.code == "image_input_not_supported" and err.param == "messages[0].content[1]"
    assert "'smollm2' does not accept images" in err.message
    err = refusal(take_images(ask(URL) * 3, MediaSettings(limit_per_prompt=2), VISION, "m"))
    assert err.code == "too_many_images" and "3 images" in err.message and "at most 2" in err.message
    for url, code, text in [("file:///etc/passwd", "image_url_not_allowed", "'file'"),
                            ("http://example.com/a.png", "image_url_not_allowed", "--allowed-media-domains"),
                            ("data:image/png;base64,!!", "invalid_image", "base64"),
                            ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), "invalid_image",
                             "not an image"),
                            ("data:image/png;base64," + base64.b64encode(PNG[:100]).decode(), "invalid_image",
                             "truncated")]:
        err = refusal(take_images(ask(url), MediaSettings(), VISION, "m"))
        assert (err.code, err.param) == (code, "messages[0].content[1]") and text in err.message, err.message
    err = refusal(take_images(ask(URL), MediaSettings(max_bytes=100), VISION, "m"))
    assert err.code == "image_too_large"
    err = refusal(take_images(ask(URL), MediaSettings(max_pixels=32 * 24 - 1), VISION, "m"))
    assert err.code == "image_too_large" and "pixels" in err.message
    missing = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
    assert refusal(take_images(missing, MediaSettings(), VISION, "m")).param == "messages[0].content[0].image_url.url"


def test_other_media_are_refused_by_name_and_text_is_unchanged() -> None:
    with pytest.raises(APIError, match="input_audio"):
        normalise_messages([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": URL}}]
    assert normalise_messages([{"role": "user", "content": parts}])[0]["content"] == parts


def test_allowed_domains() -> None:
    media = MediaSettings(allowed_domains=("images.example.com", "*.cdn.example.org"))
    assert media.allows("images.example.com") and media.allows("IMAGES.example.com.")
    assert media.allows("a.cdn.example.org") and not media.allows("cdn.example.org.evil.com")
    assert not media.allows("example.com") and not media.allows("evilimages.example.com")


@pytest.mark.parametrize("value, limit", [(None, 16), ("image=4", 4), ('{"image": 0}', 0), ("3", 3),
                                          ("image = 2", 2)])
def test_limit_mm_per_prompt_forms(value: str | None, limit: int) -> None:
    assert parse_mm_limit(value) == limit


@pytest.mark.parametrize("value, text", [("video=1", "images only"), ('{"image": -1}', "0 or more"),
                                         ("image=x", "whole number"), ("{bad", "JSON")])
def test_limit_mm_per_prompt_refusals(value: str, text: str) -> None:
    with pytest.raises(ValueError, match=text):
        parse_mm_limit(value)


class _Host(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/slow.png":
            time.sleep(1.0)
        if self.path == "/away":
            self.send_response(301)
            self.send_header("Location", "http://elsewhere.invalid/x.png")
            self.end_headers()
            return
        if self.path == "/again":
            self.send_response(302)
            self.send_header("Location", "/big-unsized.png")
            self.end_headers()
            return
        body = PNG * 50 if self.path.startswith("/big") else PNG
        self.send_response(200)
        if self.path != "/big-unsized.png":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped reading at its limit

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def host() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Host)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_fetching_keeps_to_its_limits(host: str) -> None:
    media = MediaSettings(allowed_domains=("127.0.0.1",), max_bytes=len(PNG) * 10, fetch_timeout=0.5)
    assert run(fetch_image(f"{host}/cat.png", media, "p")) == PNG
    for path, code, text in [("/big.png", "image_too_large", "bytes"), ("/again", "image_too_large", "bytes"),
                             ("/away", "image_url_not_allowed", "elsewhere.invalid"),
                             ("/slow.png", "image_fetch_failed", "longer than 0.5 s")]:
        err = refusal(fetch_image(f"{host}{path}", media, "p"))
        assert err.code == code and text in err.message, err.message


def test_responses_input_image_is_an_image_url_part() -> None:
    messages = responses_request.input_messages([{"role": "user", "content": [
        {"type": "input_text", "text": "What is it?"}, {"type": "input_image", "image_url": URL, "detail": "high"}]}])
    part = messages[0]["content"][1]
    assert part == {"type": "image_url", "image_url": {"url": URL, "detail": "high"}, CLIENT_PATH: "input[0].content[1]"}
    with pytest.raises(ProtocolError, match="file_id"):
        responses_request.input_messages([{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}])
    with pytest.raises(ProtocolError, match="input_file"):
        responses_request.input_messages([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}])
    listed = input_items([{"role": "user", "content": [{"type": "input_image", "image_url": URL, "detail": "high"}]}])
    assert listed[0]["content"] == [{"type": "input_image", "image_url": URL, "detail": "high"}]


def test_anthropic_image_blocks_keep_their_place() -> None:
    data = base64.b64encode(PNG).decode()
    chat = anthropic_request.chat_request({"max_tokens": 5, "system": "Be brief.", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "First"}, {"type": "text", "text": "this one:"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": "then"},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]})
    paths = image_paths(chat)
    assert chat["messages"][1]["content"] == [
        {"type": "text", "text": "First\nthis one:"}, {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
        {"type": "text", "text": "then"}, {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
    assert paths == {"messages[1].content[1]": "messages[0].content[2]", "messages[1].content[3]": "messages[0].content[4]"}
    err = renamed(APIError(400, "messages[1].content[3]: not fetched", "messages[1].content[3]"), paths)
    assert err.param == "messages[0].content[4]" and err.message == "messages[0].content[4]: not fetched"  # type: ignore[attr-defined]
    for source, text in [({"type": "base64", "media_type": "image/tiff", "data": data}, "media_type"),
                         ({"type": "base64", "media_type": "image/png"}, "source.data"),
                         ({"type": "file", "file_id": "x"}, "source must be")]:
        with pytest.raises(ProtocolError, match=text):
            anthropic_request.chat_request({"max_tokens": 5, "messages": [{"role": "user", "content": [
                {"type": "image", "source": source}]}]})


def test_ollama_images_are_image_url_parts_first() -> None:
    data = base64.b64encode(PNG).decode()
    assert ollama_content("hi", None, "images") == "hi"
    assert ollama_content("hi", [data], "images") == [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}, {"type": "text", "text": "hi"}]
    jpeg = base64.b64encode(b"\xff\xd8\xff\xe0rest").decode()
    assert ollama_content("", [jpeg], "images")[0]["image_url"]["url"].startswith("data:image/jpeg;base64,")
    for images, where in [("abc", "images"), ([3], "images[0]"), (["%%%%"], "images[0]")]:
        with pytest.raises(ProtocolError) as err:
            ollama_content("hi", images, "images")
        assert err.value.param == where
