"""LoRA adapters through the daemon: ``runlm configure MODEL --lora NAME=PATH`` imports the adapter into the
store, and a request naming NAME is served by the model's native backend with the adapter applied."""
from __future__ import annotations

from pathlib import Path

import pytest

from runlm.engine.llm import LLM
from runlm.engine.types.lora_request import LoRARequest
from runlm.engine.types.sampling_params import SamplingParams
from runlm.store import ModelStore
from tests.fixtures.lora import peft_adapter
from tests.runner.daemon import Daemon, runlm

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def lora_daemon(tmp_path_factory: pytest.TempPathFactory, qwen2_dir: Path):
    home = tmp_path_factory.mktemp("runlm-lora-home")
    ModelStore(home).pull(str(qwen2_dir), name="tiny-qwen2")
    d = Daemon(home).start()
    yield d
    d.stop()


def _offline(qwen2_dir: Path, adapter: Path | None) -> str:
    llm = LLM(str(qwen2_dir), kv_cache_memory="16MiB", enable_lora=True)
    lora = LoRARequest("x", 1, str(adapter)) if adapter else None
    return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                        lora_request=lora)[0].outputs[0].text


def _complete(daemon: Daemon, model: str) -> str:
    r = daemon.http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 6,
                                                   "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == (model if model == "pirate" else "tiny-qwen2:latest")
    return r.json()["choices"][0]["text"]


def test_configure_lora_serves_the_adapter_by_name(lora_daemon: Daemon, qwen2_dir: Path) -> None:
    adapter = peft_adapter("qwen2", 8, seed=3)
    done = runlm(lora_daemon.home, "configure", "tiny-qwen2", "--lora", f"pirate={adapter}")
    assert done.returncode == 0, done.stderr
    assert _complete(lora_daemon, "pirate") == _offline(qwen2_dir, adapter)
    assert _complete(lora_daemon, "tiny-qwen2") == _offline(qwen2_dir, None)
    assert len(lora_daemon.ps()) == 1  # one backend process serves the base model and its adapter


def test_bad_lora_configurations_are_refused(lora_daemon: Daemon) -> None:
    adapter = peft_adapter("qwen2", 8, seed=3)
    bad_path = runlm(lora_daemon.home, "configure", "tiny-qwen2", "--lora", "x=/no/such/adapter")
    assert bad_path.returncode == 2 and "PEFT directory or a .gguf file" in bad_path.stderr
    same_name = runlm(lora_daemon.home, "configure", "tiny-qwen2", "--lora", f"tiny-qwen2={adapter}")
    assert same_name.returncode == 1 and "name of a stored model" in same_name.stderr
    digest = "sha256:" + "0" * 64
    for body, why in ((["not", "an", "object"], "loras"), ({"../x": {"a.gguf": digest}}, "not a valid adapter name"),
                      ({"x": {"../a.gguf": digest}}, "plain file name"), ({"x": {"a.gguf": digest}}, "not in the store")):
        r = lora_daemon.http.post("/engines/_configure", json={"model": "tiny-qwen2", "loras": body})
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    r = lora_daemon.http.post("/engines/llamacpp/_configure",
                              json={"model": "tiny-qwen2", "loras": {"x": {"a.gguf": digest}}})
    assert r.status_code == 400 and "does not serve LoRA adapters" in r.json()["error"]["message"], r.text


def test_ollama_create_with_adapters(lora_daemon: Daemon, qwen2_dir: Path) -> None:
    """The official ollama client: upload the adapter's files as blobs, create a model from the base with them."""
    import ollama

    client = ollama.Client(host=lora_daemon.url)
    adapter = peft_adapter("qwen2", 8, seed=4, targets=("q_proj", "v_proj"))
    digests = {f: client.create_blob(adapter / f) for f in ("adapter_config.json", "adapter_model.safetensors")}
    assert lora_daemon.http.head(f"/api/blobs/{digests['adapter_config.json']}").status_code == 200
    assert lora_daemon.http.head("/api/blobs/sha256:" + "1" * 64).status_code == 404
    assert client.create(model="captain", from_="tiny-qwen2", adapters=digests).status == "success"
    out = client.generate(model="captain", prompt=PROMPT, raw=True, options={"temperature": 0, "num_predict": 6})
    assert out.response == _offline(qwen2_dir, adapter)
    with pytest.raises(ollama.ResponseError) as bad:
        client.create(model="x", from_="tiny-qwen2", adapters={"a.gguf": "sha256:" + "2" * 64})
    assert bad.value.status_code == 400 and "not in the store" in bad.value.error
    # the ollama client labels every body JSON, which the daemon's browser guard asks of any body
    wrong = lora_daemon.http.post("/api/blobs/sha256:" + "3" * 64, content=b"not these bytes",
                                  headers={"Content-Type": "application/json"})
    assert wrong.status_code == 400 and "digest" in wrong.text


def test_a_modelfile_adapter_goes_with_its_model_everywhere(lora_daemon: Daemon, qwen2_dir: Path,
                                                            tmp_path: Path) -> None:
    """``ADAPTER`` in a Modelfile: stored with the model (not only while the daemon runs) and applied to every
    request for it, on the daemon and in ``runlm run`` without one."""
    adapter = peft_adapter("qwen2", 8, seed=5)
    (tmp_path / "Modelfile").write_text(f"FROM tiny-qwen2\nADAPTER {adapter}\n")
    made = runlm(lora_daemon.home, "create", "sailor", "-f", str(tmp_path / "Modelfile"))
    assert made.returncode == 0, made.stderr
    r = lora_daemon.http.post("/v1/completions", json={"model": "sailor", "prompt": PROMPT, "max_tokens": 6,
                                                       "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == _offline(qwen2_dir, adapter), r.text
    def chat(model: str) -> str:
        return lora_daemon.http.post("/api/chat", json={"model": model, "stream": False, "messages": [
            {"role": "user", "content": PROMPT}], "options": {"temperature": 0, "num_predict": 6}}).json()["message"][
            "content"]

    answer = chat("sailor")
    assert answer != chat("tiny-qwen2")  # (the adapter changes this answer: a local run without it would differ)
    home = tmp_path / "no-daemon"  # the same model in a store no daemon serves: runlm run loads it itself
    ModelStore(home).pull(str(qwen2_dir), name="tiny-qwen2")
    assert runlm(home, "create", "sailor", "-f", str(tmp_path / "Modelfile")).returncode == 0
    local = runlm(home, "run", "sailor", PROMPT, "--temperature", "0", "--max-tokens", "6")
    assert local.returncode == 0, local.stderr
    assert local.stdout.strip() == answer.strip()


def test_ollama_create_with_adapters_and_settings_stores_a_model(lora_daemon: Daemon, qwen2_dir: Path) -> None:
    import ollama

    client = ollama.Client(host=lora_daemon.url)
    adapter = peft_adapter("qwen2", 8, seed=6)
    digests = {f: client.create_blob(adapter / f) for f in ("adapter_config.json", "adapter_model.safetensors")}
    assert client.create(model="bosun", from_="tiny-qwen2", adapters=digests, system="Arr.").status == "success"
    assert ModelStore(lora_daemon.home).get("bosun").manifest["modelfile"]["adapters"] == digests  # stored
    r = lora_daemon.http.post("/v1/completions", json={"model": "bosun", "prompt": PROMPT, "max_tokens": 6,
                                                       "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == _offline(qwen2_dir, adapter), r.text
    bad = lora_daemon.http.post("/api/create", json={"model": "x", "from": "tiny-qwen2", "system": "s",
                                                     "adapters": {"adapter_config.json": digests["adapter_config.json"]}})
    assert bad.status_code == 400 and "adapters" in bad.text
