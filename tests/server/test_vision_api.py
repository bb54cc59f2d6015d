"""Images on serve-engine's APIs, driven by the official clients over real sockets: OpenAI chat ``image_url`` parts
(data: URLs, and http URLs from a host --allowed-media-domains names), the Responses API's ``input_image`` and
Anthropic's ``image`` blocks answer from the image (its tokens are counted in the prompt; another image gives other
logits); every bad image is a 400 in the API's own shape naming the part, and the server answers the next request."""
from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import httpx
import openai
import pytest

from tests.fixtures.vlm import png_bytes, test_image, vlm_dir
from tests.server.conftest import API_KEY
from tests.server.process import ServerProcess

MODEL = "tiny-vlm"
GREEDY = {"temperature": 0.0, "max_tokens": 3}


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PICTURE = png_bytes(test_image(96, 64, seed=0))
OTHER = png_bytes(test_image(96, 64, seed=3))


def ask(url: str, text: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}]


class _Images(BaseHTTPRequestHandler):
    """/cat.png: the picture; /big.png: more bytes than a server takes; /hop: a redirect to another host."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/cat.png":
            body = PICTURE
        elif self.path == "/hop":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/cat.png")
            self.end_headers()
            return
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def vlm_server() -> Iterator[ServerProcess]:
    server = ServerProcess(str(vlm_dir("idefics3")), [
        "--kv-cache-memory", "64MiB", "--api-key", API_KEY, "--served-model-name", MODEL,
        "--limit-mm-per-prompt", "image=2", "--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "5",
        # short answers for what does not say (the chat page): a random-weight model never stops by itself
        "--override-generation-config", '{"max_new_tokens": 4}']).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(vlm_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=vlm_server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def first_logprobs(client: openai.OpenAI, messages: list[dict]) -> tuple[int, list[float]]:
    r = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=5, **GREEDY)
    assert r.choices[0].logprobs is not None
    return r.usage.prompt_tokens, [t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs]


def test_an_image_chat_answers_from_the_image(client: openai.OpenAI) -> None:
    tokens, seen = first_logprobs(client, ask(data_url(PICTURE)))
    text_only = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is in the picture?"}], **GREEDY)
    assert tokens > text_only.usage.prompt_tokens + 16  # the image's tokens are in the prompt
    again_tokens, again = first_logprobs(client, ask(data_url(PICTURE)))
    assert (again_tokens, again) == (tokens, seen)  # the same image: the same prompt, the same answer
    other_tokens, other = first_logprobs(client, ask(data_url(OTHER)))
    assert other_tokens == tokens and other != seen  # other pixels, other logits
    # streamed, with usage, and as a JPEG
    import PIL.Image

    jpeg = io.BytesIO()
    PIL.Image.open(io.BytesIO(PICTURE)).save(jpeg, format="JPEG")
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask(data_url(jpeg.getvalue(), "image/jpeg")),
                                                 stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == tokens


def test_two_images_in_order(client: openai.OpenAI) -> None:
    one = client.chat.completions.create(model=MODEL, messages=ask(data_url(PICTURE)), **GREEDY).usage.prompt_tokens
    both = [{"role": "user", "content": [{"type": "text", "text": "Compare"},
                                         {"type": "image_url", "image_url": {"url": data_url(PICTURE)}},
                                         {"type": "image_url", "image_url": {"url": data_url(OTHER)}}]}]
    two = client.chat.completions.create(model=MODEL, messages=both, **GREEDY).usage.prompt_tokens
    assert two > one + 16


def test_image_urls_only_from_allowed_hosts(client: openai.OpenAI, image_host: str) -> None:
    fetched, _ = first_logprobs(client, ask(f"{image_host}/cat.png"))
    inline, _ = first_logprobs(client, ask(data_url(PICTURE)))
    assert fetched == inline
    for url, code, text in [(f"{image_host}/hop", "image_url_not_allowed", "localhost"),
                            (f"{image_host}/missing.png", "image_fetch_failed", "404"),
                            ("http://example.com/cat.png", "image_url_not_allowed", "example.com"),
                            ("file:///etc/passwd", "image_url_not_allowed", "'file'"),
                            ("ftp://127.0.0.1/cat.png", "image_url_not_allowed", "'ftp'")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=ask(url), **GREEDY)
        body = err.value.body
        assert body["code"] == code and body["param"] == "messages[0].content[0]" and text in body["message"], body


def _truncated() -> bytes:
    return PICTURE[: len(PICTURE) // 2]


def _huge_in_pixels() -> bytes:
    import PIL.Image

    out = io.BytesIO()
    PIL.Image.new("1", (8000, 6000)).save(out, format="PNG")  # 48M pixels in a few kB
    return out.getvalue()


@pytest.mark.parametrize("url, code, text", [
    (data_url(b"this is not a picture"), "invalid_image", "not an image"),
    (data_url(b""), "invalid_image", ""),
    ("data:image/png;base64,@@@@", "invalid_image", "base64"),
    ("data:image/png,rawbytes", "invalid_image", "base64"),
    (data_url(_truncated()), "invalid_image", "truncated"),
    (data_url(_huge_in_pixels()), "image_too_large", "pixels"),
])
def test_bad_images_are_400s_naming_the_part(client: openai.OpenAI, url: str, code: str, text: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ask(url), **GREEDY)
    body = err.value.body
    assert body["type"] == "invalid_request_error" and body["code"] == code, body
    assert body["param"] == "messages[0].content[0]" and text in body["message"], body


def test_too_many_and_too_large(client: openai.OpenAI, vlm_server: ServerProcess) -> None:
    three = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PICTURE)}}] * 3}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=three, **GREEDY)
    assert err.value.body["code"] == "too_many_images" and "at most 2" in err.value.body["message"]
    # more bytes than an image may have (20 MiB), in a body the server still reads (32 MiB by default)
    big = data_url(bytes(21 << 20))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ask(big), **GREEDY)
    assert err.value.body["code"] == "image_too_large" and "bytes" in err.value.body["message"]
    # other media are refused by name; the server goes on answering
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=audio, **GREEDY)
    assert err.value.body["param"] == "messages[0].content[0]" and "input_audio" in err.value.body["message"]
    assert client.chat.completions.create(model=MODEL, messages=ask(data_url(PICTURE)), **GREEDY).choices


def test_responses_input_image(client: openai.OpenAI) -> None:
    chat_tokens, _ = first_logprobs(client, ask(data_url(PICTURE)))
    r = client.responses.create(model=MODEL, max_output_tokens=3, temperature=0.0, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(PICTURE), "detail": "auto"},
        {"type": "input_text", "text": "What is in the picture?"}]}])
    assert r.status in ("completed", "incomplete") and r.usage is not None
    assert r.usage.input_tokens == chat_tokens
    follow = client.responses.create(model=MODEL, max_output_tokens=3, temperature=0.0, previous_response_id=r.id,
                                     input="And its colours?")
    assert follow.usage is not None and follow.usage.input_tokens > chat_tokens  # the image is in the history
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": data_url(b"nope")}]}])
    assert err.value.body["param"] == "input[0].content[1]" and "not an image" in err.value.body["message"]


def test_anthropic_image_blocks(vlm_server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=vlm_server.url, api_key=API_KEY, max_retries=0, timeout=120)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PICTURE).decode()}}
    message = client.messages.create(model=MODEL, max_tokens=3, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [image, {"type": "text", "text": "What is in the picture?"}]}])
    assert message.content and message.usage.input_tokens > 16
    counted = client.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": [image, {"type": "text", "text": "What is in the picture?"}]}])
    assert counted.input_tokens == message.usage.input_tokens  # the image's tokens counted as the answer counts them
    bad = {**image, "source": {**image["source"], "data": base64.b64encode(_truncated()).decode()}}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=3, messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi"}, bad]}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[1]" in err.value.body["error"]["message"]
    assert "truncated" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="media_type"):
        client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": [
            {**image, "source": {**image["source"], "media_type": "image/tiff"}}]}])
    with pytest.raises(anthropic.BadRequestError, match="does not fetch"):
        client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])


def test_tokenize_counts_the_image_tokens(vlm_server: ServerProcess, client: openai.OpenAI) -> None:
    tokens, _ = first_logprobs(client, ask(data_url(PICTURE)))
    r = httpx.post(f"{vlm_server.url}/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "messages": ask(data_url(PICTURE))})
    assert r.status_code == 200 and r.json()["count"] == tokens


def test_reset_mm_cache_route(vlm_server: ServerProcess, client: openai.OpenAI) -> None:
    _, before = first_logprobs(client, ask(data_url(PICTURE)))
    r = httpx.post(f"{vlm_server.url}/reset_mm_cache", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200
    _, after = first_logprobs(client, ask(data_url(PICTURE)))
    assert after == before


def test_a_text_only_model_refuses_images_on_every_api(smollm2_server: ServerProcess) -> None:
    oa = openai.OpenAI(base_url=smollm2_server.base_url, api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model="smollm2", messages=ask(data_url(PICTURE)), max_tokens=2)
    body = err.value.body
    assert body["code"] == "image_input_not_supported" and body["param"] == "messages[0].content[0]"
    assert "'smollm2' does not accept images" in body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        oa.responses.create(model="smollm2", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(PICTURE)}]}])
    assert err.value.body["param"] == "input[0].content[0]" and "does not accept images" in err.value.body["message"]
    an = anthropic.Anthropic(base_url=smollm2_server.url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="does not accept images"):
        an.messages.create(model="smollm2", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PICTURE).decode()}}]}])
    # an image a tool returned is refused the same way (Anthropic's tool_result, OpenAI's tool message)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PICTURE).decode()}}
    with pytest.raises(anthropic.BadRequestError) as aerr:
        an.messages.create(model="smollm2", max_tokens=2, messages=[
            {"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "here"}, image]}]}])
    assert aerr.value.status_code == 400 and "does not accept images" in str(aerr.value.body)
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model="smollm2", max_tokens=2, messages=[
            {"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "tool_calls": [{"id": "t1", "type": "function",
                                                  "function": {"name": "shot", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "t1", "content": [
                {"type": "image_url", "image_url": {"url": data_url(PICTURE)}}]}])
    assert err.value.body["code"] == "image_input_not_supported" and err.value.body["param"] == "messages[2].content[0]"
    assert oa.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=2).choices


def test_runlm_run_through_a_server_sends_image_url_parts(vlm_server: ServerProcess, monkeypatch) -> None:
    """`runlm run MODEL PROMPT --image FILE` with a daemon: the images go as data: URLs, stay in the conversation."""
    from runlm.cli.client import CLIError, Daemon
    from runlm.cli.run_daemon import DaemonChat
    from runlm.engine.types.sampling_params import SamplingParams

    monkeypatch.setenv("RUNLM_API_KEY", API_KEY)
    chat = DaemonChat(Daemon(vlm_server.url), MODEL, SamplingParams(temperature=0.0, max_tokens=3), None)
    first = chat.reply("What is in the picture?", io.StringIO(), [PICTURE])
    assert first and chat.history[0]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert chat.reply("And its colours?", io.StringIO()) is not None and len(chat.history) == 4
    with pytest.raises(CLIError, match="not an image"):
        chat.reply("and this?", io.StringIO(), [b"GIF89a-not-really"])
    assert len(chat.history) == 4  # the refused turn is not kept


def test_chat_page_attaches_and_pastes_images(vlm_server: ServerProcess, tmp_path) -> None:
    """The chat page in Chromium: an attached image shows beside the question and goes as an image_url data: URL;
    a pasted one is attached too."""
    import os
    import shutil

    chromium = os.environ.get("RUNLM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no Chromium installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    picture = tmp_path / "cat.png"
    picture.write_bytes(PICTURE)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            problems: list[str] = []
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            sent: list[dict] = []
            page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/chat/completions") else None)
            page.goto(f"{vlm_server.url}/")
            page.fill("#api-key", API_KEY)
            page.dispatch_event("#api-key", "change")
            page.locator("#model option").first.wait_for(state="attached")
            page.fill("#temperature", "0")
            page.dispatch_event("#temperature", "change")
            page.set_input_files("#image-file", str(picture))
            page.wait_for_selector("#attachments img")
            page.fill("#prompt", "What is in the picture?")
            page.press("#prompt", "Enter")
            page.wait_for_selector(".msg.assistant[data-done]", timeout=120_000)
            assert page.locator(".msg.assistant").first.get_attribute("data-done") == "complete"
            assert page.locator(".msg.error").count() == 0, page.locator(".msg.assistant .body").first.inner_text()
            shown = page.locator(".msg.user .images img").first.get_attribute("src")
            assert shown is not None and shown.startswith("data:image/png;base64,")
            assert page.locator("#attachments img").count() == 0  # sent: the composer is empty again
            part = sent[0]["messages"][-1]["content"][0]
            assert part["type"] == "image_url" and base64.b64decode(part["image_url"]["url"].split(",", 1)[1]) == PICTURE
            # a pasted image is attached (a paste event carrying a file, as the browser makes one)
            page.evaluate("""(b64) => {
                const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
                const data = new DataTransfer();
                data.items.add(new File([bytes], "pasted.png", { type: "image/png" }));
                document.getElementById("prompt").dispatchEvent(
                    new ClipboardEvent("paste", { clipboardData: data, bubbles: true, cancelable: true }));
            }""", base64.b64encode(PICTURE).decode())
            page.wait_for_selector("#attachments img")
            page.screenshot(path=os.environ.get("RUNLM_SCREENSHOT", str(tmp_path / "chat-image.png")))
            assert not [p for p in problems if "401" not in p], problems  # (the key-less first /v1/models: 401)
        finally:
            browser.close()


def test_models_say_which_take_images(client: openai.OpenAI, smollm2_server: ServerProcess) -> None:
    card = client.models.retrieve(MODEL)
    assert card.model_extra is not None and card.model_extra["capabilities"] == ["completion", "vision"]
    text = openai.OpenAI(base_url=smollm2_server.base_url, api_key=API_KEY).models.list().data[0]
    assert text.model_extra is not None and text.model_extra["capabilities"] == ["completion"]


def test_streamed_usage_counts_the_image_from_the_start(vlm_server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=vlm_server.url, api_key=API_KEY, max_retries=0, timeout=120)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PICTURE).decode()}}
    body = dict(model=MODEL, max_tokens=3, extra_body={"temperature": 0},
                messages=[{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}])
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        started = next(e for e in stream if e.type == "message_start").message.usage
        final = stream.get_final_message()
    assert started.input_tokens == whole.usage.input_tokens == final.usage.input_tokens
    assert final.content[0].text == whole.content[0].text


def test_bad_images_beside_a_good_one(client: openai.OpenAI) -> None:
    """Refusals while an image chat runs leave it alone: it answers as it does alone."""
    from concurrent.futures import ThreadPoolExecutor

    alone = client.chat.completions.create(model=MODEL, messages=ask(data_url(PICTURE)), **GREEDY)

    def bad(i: int) -> int:
        try:
            client.chat.completions.create(model=MODEL, messages=ask(data_url(_truncated() if i % 2 else b"x")),
                                           **GREEDY)
        except openai.BadRequestError as exc:
            return exc.status_code
        return 200

    with ThreadPoolExecutor(6) as pool:
        good = pool.submit(client.chat.completions.create, model=MODEL, messages=ask(data_url(PICTURE)), **GREEDY)
        codes = list(pool.map(bad, range(8)))
        beside = good.result()
    assert codes == [400] * 8
    assert beside.choices[0].message.content == alone.choices[0].message.content
    assert beside.usage.prompt_tokens == alone.usage.prompt_tokens
