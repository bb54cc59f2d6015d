"""Fill-in-the-middle on serve-engine: completions' ``suffix`` through the official openai client, and
llama-server's ``/infill`` (whole and streamed), each equal to the same prompt sent as token ids."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from runlm.formats.fim import ExtraChunk, infill_prompt, suffix_prompt
from runlm.formats.gguf import GGUFFile
from runlm.formats.tokenizer import Tokenizer
from tests.fixtures.models import fim_gguf
from tests.server.conftest import API_KEY
from tests.server.process import ServerProcess

PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
CONTEXT = 1024


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(str(fim_gguf("qwen")), ["--kv-cache-memory", "64MiB", "--max-model-len", str(CONTEXT),
                                              "--served-model-name", "coder"]).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(str(fim_gguf("qwen"))))


def test_completions_suffix_is_the_fim_prompt(server, tok: Tokenizer) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    got = client.completions.create(model="coder", prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0)
    ids = suffix_prompt(tok, tok.fim, PREFIX, SUFFIX)
    want = client.completions.create(model="coder", prompt=ids, max_tokens=8, temperature=0)
    assert got.choices[0].text == want.choices[0].text and got.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="coder", prompt=PREFIX, suffix=SUFFIX, echo=True, max_tokens=2)
    assert err.value.body["param"] == "echo"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="coder", prompt=[1, 2, 3], suffix=SUFFIX, max_tokens=2)


def test_infill_whole_and_streamed_as_llama_server_answers(server, tok: Tokenizer) -> None:
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "",
            "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}],
            "n_predict": 8, "temperature": 0, "cache_prompt": True, "t_max_predict_ms": 1000}
    whole = httpx.post(f"{server.url}/infill", json=body, timeout=60).json()
    ids = infill_prompt(tok, tok.fim, PREFIX, SUFFIX, [ExtraChunk("def sub(a, b):\n    return a - b\n", "util.py")],
                        n_ctx=CONTEXT)
    want = httpx.post(f"{server.url}/v1/completions",
                      json={"prompt": ids, "max_tokens": 8, "temperature": 0}, timeout=60).json()
    assert whole["content"] == want["choices"][0]["text"] and whole["stop"] is True
    n = want["usage"]["completion_tokens"]
    assert whole["tokens_predicted"] == n and whole["tokens_evaluated"] == len(ids)
    assert whole["stop_type"] == {"length": "limit", "stop": "eos"}[want["choices"][0]["finish_reason"]]
    assert whole["prompt"] == tok.decode(ids) and whole["timings"]["predicted_n"] == n
    with httpx.stream("POST", f"{server.url}/infill", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["stop"] for e in events].count(True) == 1 and events[-1]["stop"]
    assert "".join(e["content"] for e in events) == whole["content"]


def test_infill_refusals(server, smollm2_server) -> None:
    bad = httpx.post(f"{server.url}/infill", json={"input_prefix": "x"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input_suffix"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    none = httpx.post(f"{smollm2_server.url}/infill", json={"input_prefix": "a", "input_suffix": "b"},
                      headers=headers, timeout=30)
    assert none.status_code == 400 and none.json()["error"]["code"] == "fim_unsupported"
    assert "fill-in-the-middle" in none.json()["error"]["message"]
    none = httpx.post(f"{smollm2_server.url}/v1/completions", json={"prompt": "a", "suffix": "b"}, headers=headers,
                      timeout=30)
    assert none.status_code == 400 and none.json()["error"]["param"] == "suffix"
