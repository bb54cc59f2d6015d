"""LoRA adapters over HTTP with the official ``openai`` client: a request's model names an adapter,
/v1/models lists adapters under their base, and /v1/load_lora_adapter and /v1/unload_lora_adapter
(vLLM's routes) change the set while serving, behind the API key."""
from __future__ import annotations

import httpx
import openai
import pytest

from runlm.engine.llm import LLM
from runlm.engine.types.lora_request import LoRARequest
from runlm.engine.types.sampling_params import SamplingParams
from tests.fixtures.lora import peft_adapter
from tests.fixtures.models import build_model
from tests.server.process import ServerProcess

KEY = "lora-key"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server():
    server = ServerProcess(str(build_model("qwen2")), [
        "--api-key", KEY, "--served-model-name", "base", "--kv-cache-memory", "64MiB", "--enable-lora",
        "--lora-modules", f"a={peft_adapter('qwen2', 8, seed=1)}", "--max-loras", "2", "--max-lora-rank", "8"]).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def _offline(lora: LoRARequest | None) -> str:
    llm = LLM(str(build_model("qwen2")), kv_cache_memory="16MiB", enable_lora=True, max_lora_rank=8)
    return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        lora_request=lora)[0].outputs[0].text


def _complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


def test_model_field_selects_the_adapter(client: openai.OpenAI) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"base", "a"}
    assert models["a"].parent == "base" and models["base"].parent is None  # type: ignore[attr-defined]
    with_a, plain = _complete(client, "a"), _complete(client, "base")
    assert with_a == _offline(LoRARequest("a", 1, str(peft_adapter("qwen2", 8, seed=1))))
    assert plain == _offline(None) and plain != with_a
    chunks = list(client.chat.completions.create(model="a", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=4, stream=True))
    assert chunks and all(c.model == "a" for c in chunks)


def test_load_and_unload_while_serving(server, client: openai.OpenAI) -> None:
    path = str(peft_adapter("qwen2", 8, seed=2, targets=("q_proj", "v_proj")))
    url = server.url
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": path}).status_code == 401
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": path}, headers=auth)
    assert r.status_code == 200 and "Success" in r.text
    assert "b" in {m.id for m in client.models.list().data}
    assert client.models.retrieve("b").parent == "base"  # type: ignore[attr-defined]
    assert _complete(client, "b") == _offline(LoRARequest("b", 2, path))
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": path}, headers=auth)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "/no/such/adapter"},
                     headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=auth)
    assert r.status_code == 200 and "removed" in r.text
    assert "b" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.APIStatusError) as gone:
        _complete(client, "b")
    assert gone.value.status_code == 421
    missing = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "lora_not_found"
    assert _complete(client, "a")  # the adapter loaded at start still serves


def test_lora_modules_are_name_equals_path() -> None:
    from runlm.cli.serve_engine import parse_lora_modules

    assert parse_lora_modules(["a=/x", "b=rel/y=z"]) == {"a": "/x", "b": "rel/y=z"}
    for bad in (["noequals"], ["=path"], ["a="], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)
