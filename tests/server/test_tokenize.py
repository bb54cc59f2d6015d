"""/v1/tokenize, /v1/detokenize, /v1/count_tokens over the model's real tokenizer and chat template."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import API_KEY


@pytest.fixture(scope="module")
def http(smollm2_server):
    with httpx.Client(base_url=smollm2_server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def test_tokenize_detokenize_round_trip(http: httpx.Client) -> None:
    text = "Héllo wörld, 😀!"
    r = http.post("/v1/tokenize", json={"prompt": text, "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) and body["max_model_len"] == 8192
    assert len(body["token_strs"]) == body["count"]
    assert http.post("/v1/detokenize", json={"tokens": body["tokens"]}).json()["prompt"] == text
    assert http.post("/tokenize", json={"prompt": text}).json()["tokens"] == body["tokens"]  # vLLM's path


def test_chat_messages_count_like_the_chat_endpoint(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    counted = http.post("/v1/count_tokens", json={"messages": messages}).json()
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert counted["count"] == counted["input_tokens"] == chat["usage"]["prompt_tokens"]
    no_gen = http.post("/v1/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_gen["count"] < counted["count"]


def test_tokenize_errors(http: httpx.Client) -> None:
    assert http.post("/v1/tokenize", json={}).status_code == 400
    assert http.post("/v1/tokenize", json={"prompt": "a", "messages": []}).status_code == 400
    r = http.post("/v1/detokenize", json={"tokens": [1, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert http.post("/v1/detokenize", json={"tokens": [1, 2**80]}).status_code == 400
    assert http.post("/v1/tokenize", json={"model": "other", "prompt": "a"}).status_code == 421
