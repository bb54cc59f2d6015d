"""Image generation through a real daemon: the diffusers backend in its own process, the openai client,
the runner's load / unload / crash handling, the CLI."""
from __future__ import annotations

import base64
import io
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest
from PIL import Image

from runlm.store import ModelStore
from tests.runner.daemon import Daemon, runlm

MODEL = "tiny-sd"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_sd: Path) -> Iterator[Daemon]:
    home = tmp_path_factory.mktemp("runlm-images")
    ModelStore(home).pull(str(tiny_sd), MODEL)
    d = Daemon(home).start()
    # one torch thread: the pipeline is a few thousand parameters, and the test machine is shared
    resp = d.http.post("/engines/diffusers/_configure", json={"model": MODEL, "runtime_flags": ["--threads", "1"]})
    assert resp.status_code == 202, resp.text
    yield d
    d.stop()


def client(daemon: Daemon, prefix: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + prefix, api_key="unused", max_retries=0)


def png(b64: str | None) -> Image.Image:
    assert b64 is not None
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return image


def test_openai_client_generates_images(daemon: Daemon) -> None:
    out = client(daemon).images.generate(model=MODEL, prompt="a red cat", n=2, size="48x32",  # type: ignore[arg-type]
                                         response_format="b64_json", extra_body={"seed": 11, "steps": 2})
    assert out.data is not None and len(out.data) == 2
    first, second = (png(d.b64_json) for d in out.data)
    assert first.size == second.size == (48, 32)
    assert first.tobytes() != second.tobytes()  # seeds 11 and 12
    # the same seed through Model Runner's own paths gives the same bytes
    for prefix in ("/engines/v1", "/engines/diffusers/v1"):
        again = client(daemon, prefix).images.generate(model=MODEL, prompt="a red cat", size="48x32",  # type: ignore[arg-type]
                                                       extra_body={"seed": 11, "steps": 2})
        assert again.data is not None and again.data[0].b64_json == out.data[0].b64_json
    (runner,) = daemon.ps()
    assert runner["backend_name"] == "diffusers" and runner["mode"] == "image-generation"
    assert psutil.Process(runner["pid"]).is_running()


def test_streamed_generation_reports_each_step(daemon: Daemon) -> None:
    body = {"model": MODEL, "prompt": "a cat", "size": "16x16", "steps": 3, "seed": 5, "stream": True}
    with daemon.http.stream("POST", "/v1/images/generations", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[5:]) for line in resp.iter_lines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    progress = [(e["step"], e["total_steps"]) for e in events if e["type"] == "image_generation.progress"]
    assert progress == [(1, 3), (2, 3), (3, 3)]
    (done,) = [e for e in events if e["type"] == "image_generation.completed"]
    assert png(done["b64_json"]).size == (16, 16) and done["seed"] == 5
    # the openai client reads the same stream
    stream = client(daemon).images.generate(model=MODEL, prompt="a cat", size="16x16", stream=True,  # type: ignore[arg-type]
                                            extra_body={"steps": 3, "seed": 5})
    completed = [e for e in stream if e.type == "image_generation.completed"]
    assert len(completed) == 1 and completed[0].b64_json == done["b64_json"]


@pytest.mark.parametrize("fields, param", [
    ({"size": "100x100"}, "size"),       # not multiples of 8
    ({"size": "4096x4096"}, "size"),     # over the limit
    ({"n": 11}, "n"),
    ({"scheduler": "nope"}, "scheduler"),
    ({"response_format": "url"}, "response_format"),
])
def test_bad_requests_are_openai_400s(daemon: Daemon, fields: dict, param: str) -> None:
    resp = daemon.http.post("/engines/v1/images/generations", json={"model": MODEL, "prompt": "x", **fields})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_an_image_model_does_only_images(daemon: Daemon) -> None:
    resp = daemon.http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "unsupported_mode"
    assert "/v1/images/generations" in resp.json()["error"]["message"]
    resp = daemon.http.post("/engines/native/v1/images/generations", json={"model": MODEL, "prompt": "x"})
    assert resp.status_code == 400 and "native backend cannot serve image-generation" in resp.json()["error"]["message"]


def test_show_reports_pipeline_class_and_components(daemon: Daemon) -> None:
    shown = daemon.http.get(f"/models/{MODEL}").json()["config"]
    assert shown["format"] == "diffusers" and shown["architecture"] == "StableDiffusionPipeline"
    assert shown["components"]["unet"] == "diffusers.UNet2DConditionModel"
    assert shown["capabilities"] == ["image-generation"]
    out = runlm(daemon.home, "show", MODEL)
    assert out.returncode == 0, out.stderr
    assert "StableDiffusionPipeline" in out.stdout and "transformers.CLIPTextModel" in out.stdout


def test_cli_generate_image(daemon: Daemon, tmp_path: Path) -> None:
    target = tmp_path / "out.png"
    out = runlm(daemon.home, "generate-image", MODEL, "a", "red", "cat", "-o", str(target), "--steps", "2",
                "--seed", "3", "--size", "24x16")
    assert out.returncode == 0, out.stderr
    assert Image.open(target).size == (24, 16) and "seed 3" in out.stdout
    assert "step 2/2" in out.stderr  # progress, streamed from the daemon
    direct = client(daemon).images.generate(model=MODEL, prompt="a red cat", size="24x16",  # type: ignore[arg-type]
                                            extra_body={"seed": 3, "steps": 2})
    assert direct.data is not None and base64.b64decode(direct.data[0].b64_json or "") == target.read_bytes()


def test_ollama_client_generates_images(daemon: Daemon) -> None:
    ollama = pytest.importorskip("ollama")
    c = ollama.Client(host=daemon.url)
    out = c.generate(model=MODEL, prompt="a red cat", width=48, height=32, steps=2, options={"seed": 11})
    assert out.done and png(out.image).size == (48, 32)
    same = client(daemon).images.generate(model=MODEL, prompt="a red cat", size="48x32",  # type: ignore[arg-type]
                                          extra_body={"seed": 11, "steps": 2})
    assert same.data is not None and same.data[0].b64_json == out.image
    parts = list(c.generate(model=MODEL, prompt="a red cat", width=16, height=16, steps=3, stream=True))
    assert [(p.completed, p.total) for p in parts[:-1]] == [(1, 3), (2, 3), (3, 3)]
    assert parts[-1].done and png(parts[-1].image).size == (16, 16)
    assert c.generate(model=MODEL, prompt="").done_reason == "load"  # an empty prompt loads the model
    with pytest.raises(ollama.ResponseError, match="multiples of 8"):
        c.generate(model=MODEL, prompt="x", width=30, height=30)


@pytest.mark.slow  # a second load of the pipeline (diffusers' imports take most of it)
def test_a_crashed_backend_is_unloaded_and_reloads(daemon: Daemon) -> None:
    body = {"model": MODEL, "prompt": "x", "size": "16x16", "steps": 1, "seed": 1}
    assert daemon.http.post("/v1/images/generations", json=body).status_code == 200
    pid = daemon.pid_of(f"{MODEL}:latest")
    os.kill(pid, signal.SIGKILL)
    assert daemon.wait_unloaded(f"{MODEL}:latest")
    resp = daemon.http.post("/v1/images/generations", json=body)
    assert resp.status_code == 200, resp.text
    assert daemon.pid_of(f"{MODEL}:latest") != pid


def test_unload_stops_the_backend_process(daemon: Daemon) -> None:
    if not daemon.ps():
        assert daemon.http.post("/v1/images/generations", json={"model": MODEL, "prompt": "x", "size": "16x16",
                                                                "steps": 1}).status_code == 200
    pid = daemon.pid_of(f"{MODEL}:latest")
    resp = daemon.http.post("/engines/unload", json={"models": [MODEL]})
    assert resp.json() == {"unloaded_runners": 1}
    assert daemon.ps() == []
    assert not psutil.pid_exists(pid)  # the unload answers once the process has exited


@pytest.mark.slow  # three model loads
def test_image_and_text_models_share_the_memory_budget(tmp_path: Path, tiny_sd: Path) -> None:
    """Each fits the budget alone, not both: loading one evicts the other (least recently used, idle)."""
    store = ModelStore(tmp_path / "home")
    store.pull("tinycoder")
    store.pull(str(tiny_sd), MODEL)
    d = Daemon(tmp_path / "home", args=("--memory-budget", "900MiB")).start()
    try:
        image = {"model": MODEL, "prompt": "x", "size": "16x16", "steps": 1}
        text = {"model": "tinycoder", "prompt": "a", "max_tokens": 1}
        assert d.http.post("/v1/completions", json=text).status_code == 200
        assert d.http.post("/v1/images/generations", json=image).status_code == 200
        assert [r["model_name"] for r in d.ps()] == [f"{MODEL}:latest"]  # tinycoder made room
        assert d.http.post("/v1/completions", json=text).status_code == 200
        assert [r["model_name"] for r in d.ps()] == ["tinycoder:latest"]
        assert d.http.post("/v1/images/generations", json={**image, "keep_alive": 0}).status_code == 200
        assert d.wait_unloaded(f"{MODEL}:latest")  # keep_alive 0: unloaded once the answer is out
    finally:
        d.stop()
