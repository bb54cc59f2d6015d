"""A GGUF pulled with llama.cpp's projector beside it is served with images by the daemon: the store keeps the
mmproj, the runner starts ``serve-engine --mmproj`` on the store's copy, and an image chat answers on OpenAI's
and Ollama's routes (the tiny SmolVLM GGUF + mmproj that llama.cpp's converter writes)."""
from __future__ import annotations

import base64
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from runlm.runner.app import create_app
from runlm.store import ModelStore


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    from tests.fixtures.vlm.gguf import vlm_gguf

    text, proj = vlm_gguf("idefics3")
    root = tmp_path_factory.mktemp("served-vlm")
    files = root / "files"
    files.mkdir()
    shutil.copy(text, files / "tiny-smolvlm.gguf")
    shutil.copy(proj, files / "mmproj-tiny-smolvlm-f32.gguf")
    ModelStore(root / "home").pull(str(files / "tiny-smolvlm.gguf"), "tiny-vlm")
    with TestClient(create_app(ModelStore(root / "home")), base_url="http://127.0.0.1") as c:
        yield c


def _png() -> str:
    from tests.fixtures.vlm import png_bytes, test_image

    return base64.b64encode(png_bytes(test_image(96, 64))).decode()


def test_image_chat_through_the_daemon(client: TestClient) -> None:
    assert client.post("/api/show", json={"model": "tiny-vlm"}).json()["capabilities"] == ["completion", "vision"]
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + _png()}}]
    body = {"model": "tiny-vlm", "max_tokens": 3, "temperature": 0}
    with_image = client.post("/v1/chat/completions", json={**body, "messages": [
        {"role": "user", "content": [*image, {"type": "text", "text": "What is this?"}]}]})
    assert with_image.status_code == 200, with_image.text
    text_only = client.post("/v1/chat/completions", json={**body, "messages": [
        {"role": "user", "content": "What is this?"}]})
    # the 96x64 picture is 2 x 2 tiles and the global image, 16 rows each, plus its markers
    assert with_image.json()["usage"]["prompt_tokens"] - text_only.json()["usage"]["prompt_tokens"] >= 80
    ollama = client.post("/api/chat", json={"model": "tiny-vlm", "stream": False, "options": {"num_predict": 2},
                                            "messages": [{"role": "user", "content": "What is this?",
                                                          "images": [_png()]}]})
    assert ollama.status_code == 200, ollama.text
    assert ollama.json()["prompt_eval_count"] == with_image.json()["usage"]["prompt_tokens"]


def test_the_backend_was_started_with_the_stores_projector(client: TestClient) -> None:
    client.post("/v1/chat/completions", json={"model": "tiny-vlm", "max_tokens": 1,
                                              "messages": [{"role": "user", "content": "hi"}]})
    store: ModelStore = client.app.state.store  # type: ignore[attr-defined]
    runner = next(iter(client.app.state.loader.runners.values()))  # type: ignore[attr-defined]
    pid = runner.backend.process_id(runner.address)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    assert Path(argv[argv.index("--mmproj") + 1]) == store.mmproj_path(store.get("tiny-vlm"))
