"""Images through the daemon (runlm serve): Ollama's ``images`` on /api/chat and /api/generate with the official
``ollama`` client (a vision model answers from the image, its tokens counted in prompt_eval_count; a bad image or an
image for a text-only model is a 400 in Ollama's shape, and the daemon answers the next request), and OpenAI's and
Anthropic's image parts proxied to the model's backend."""
from __future__ import annotations

import base64
import inspect
from collections.abc import Iterator
from pathlib import Path

import anthropic
import ollama
import openai
import pytest

import runlm.runner.ollama_convert
from runlm.store import ModelStore
from tests.fixtures.vlm import png_bytes, test_image, vlm_dir
from tests.runner.daemon import Daemon

wired = pytest.mark.skipif("ollama_content" not in inspect.getsource(runlm.runner.ollama_convert),
                                reason="the daemon's Ollama routes do not pass images on yet (runlm/runner wiring)")

PICTURE = png_bytes(test_image(96, 64, seed=0))
OTHER = png_bytes(test_image(96, 64, seed=3))
GREEDY = {"temperature": 0, "num_predict": 3}


@pytest.fixture(scope="module")
def vision_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    home = tmp_path_factory.mktemp("runlm-home")
    store = ModelStore(home)
    store.pull(str(vlm_dir("idefics3")), "tiny-vlm")
    store.pull("tinycoder")
    d = Daemon(home).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(vision_daemon: Daemon) -> ollama.Client:
    return ollama.Client(host=vision_daemon.url)


@wired
def test_chat_with_images(client: ollama.Client, tmp_path: Path) -> None:
    ask = {"role": "user", "content": "What is in the picture?"}
    plain = client.chat("tiny-vlm", messages=[ask], options=GREEDY)
    seen = client.chat("tiny-vlm", messages=[{**ask, "images": [PICTURE]}], options=GREEDY)
    assert seen.done and seen.prompt_eval_count > plain.prompt_eval_count + 16  # the image's tokens
    # a path and base64 are the same image to the client; the answer is the same greedy one
    path = tmp_path / "cat.png"
    path.write_bytes(PICTURE)
    again = client.chat("tiny-vlm", messages=[{**ask, "images": [str(path)]}], options=GREEDY)
    assert again.message.content == seen.message.content and again.prompt_eval_count == seen.prompt_eval_count
    streamed = list(client.chat("tiny-vlm", messages=[{**ask, "images": [base64.b64encode(OTHER).decode()]}],
                                options=GREEDY, stream=True))
    assert streamed[-1].done and streamed[-1].prompt_eval_count == seen.prompt_eval_count
    # a follow-up turn keeps the image in the conversation
    follow = client.chat("tiny-vlm", options=GREEDY, messages=[
        {**ask, "images": [PICTURE]}, {"role": "assistant", "content": seen.message.content},
        {"role": "user", "content": "And its colours?"}])
    assert follow.prompt_eval_count > seen.prompt_eval_count


@wired
def test_generate_with_images(client: ollama.Client) -> None:
    plain = client.generate("tiny-vlm", "Describe the picture.", options=GREEDY)
    seen = client.generate("tiny-vlm", "Describe the picture.", images=[PICTURE], options=GREEDY)
    assert seen.done and seen.prompt_eval_count > plain.prompt_eval_count + 16
    with pytest.raises(ollama.ResponseError) as err:
        client.generate("tiny-vlm", "Describe.", images=[PICTURE], raw=True)
    assert err.value.status_code == 400 and "raw" in err.value.error


@wired
def test_bad_images_are_400s_in_ollamas_shape(client: ollama.Client, vision_daemon: Daemon) -> None:
    for body, text in [
        ({"messages": [{"role": "user", "content": "hi", "images": [base64.b64encode(b"not a picture").decode()]}]},
         "not an image"),
        ({"messages": [{"role": "user", "content": "hi", "images": [base64.b64encode(PICTURE[:300]).decode()]}]},
         "truncated"),
        ({"messages": [{"role": "user", "content": "hi", "images": ["%%%not base64%%%"]}]}, "base64"),
        ({"messages": [{"role": "user", "content": "hi", "images": [7]}]}, "messages[0].images[0]"),
    ]:
        r = vision_daemon.http.post("/api/chat", json={"model": "tiny-vlm", "stream": False, **body})
        assert r.status_code == 400 and text in r.json()["error"], r.text
    with pytest.raises(ollama.ResponseError) as err:
        client.generate("tiny-vlm", "hi", images=[base64.b64encode(b"GIF89a broken").decode()])
    assert err.value.status_code == 400 and "image" in err.value.error
    assert client.chat("tiny-vlm", messages=[{"role": "user", "content": "hi", "images": [PICTURE]}],
                       options=GREEDY).done


@wired
def test_a_text_only_model_refuses_images(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        client.chat("tinycoder", messages=[{"role": "user", "content": "hi", "images": [PICTURE]}], options=GREEDY)
    assert err.value.status_code == 400 and "does not accept images" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.generate("tinycoder", "hi", images=[PICTURE], options=GREEDY)
    assert err.value.status_code == 400 and "does not accept images" in err.value.error
    assert client.generate("tinycoder", "hi", options=GREEDY).done


def test_openai_and_anthropic_images_through_the_daemon(vision_daemon: Daemon) -> None:
    url = f"data:image/png;base64,{base64.b64encode(PICTURE).decode()}"
    oa = openai.OpenAI(base_url=f"{vision_daemon.url}/v1", api_key="none", max_retries=0)
    ask = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": "What is in the picture?"}]}]
    seen = oa.chat.completions.create(model="tiny-vlm", messages=ask, temperature=0, max_tokens=3)
    plain = oa.chat.completions.create(model="tiny-vlm", temperature=0, max_tokens=3,
                                       messages=[{"role": "user", "content": "What is in the picture?"}])
    assert seen.usage.prompt_tokens > plain.usage.prompt_tokens + 16
    r = oa.responses.create(model="tiny-vlm", max_output_tokens=3, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": url}, {"type": "input_text", "text": "What is in the picture?"}]}])
    assert r.usage is not None and r.usage.input_tokens == seen.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as err:
        oa.responses.create(model="tiny-vlm", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    assert err.value.body["param"] == "input[0].content[1]" and "not an image" in err.value.body["message"]
    an = anthropic.Anthropic(base_url=vision_daemon.url, api_key="none", max_retries=0)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PICTURE).decode()}}
    message = an.messages.create(model="tiny-vlm", max_tokens=3, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [image, {"type": "text", "text": "What is in the picture?"}]}])
    assert message.usage.input_tokens == seen.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model="tinycoder", messages=ask, max_tokens=2)
    assert err.value.body["code"] == "image_input_not_supported" and "does not accept images" in err.value.body["message"]
