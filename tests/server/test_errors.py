"""Bad input gets OpenAI's error shape with the right status, and never reaches the engine."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(smollm2_server):
    with httpx.Client(base_url=smollm2_server.url, headers=AUTH, timeout=60) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param: str | None = None, text: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param, err
    assert text in err["message"], err
    return err


@pytest.mark.parametrize("body, param, text", [
    ({"messages": HI, "temperature": "hot"}, "temperature", "number"),
    ({"messages": HI, "temperature": 3.5}, "temperature", "2"),
    ({"messages": HI, "max_tokens": 10**30}, "max_tokens", ""),
    ({"messages": HI, "max_tokens": 0}, "max_tokens", ""),
    ({"messages": HI, "n": 10**40}, "n", "128"),
    ({"messages": HI, "top_p": 0}, "top_p", ""),
    ({"messages": HI, "seed": 2**70}, "seed", ""),
    ({"messages": HI, "stream": "yes"}, "stream", ""),
    ({"messages": HI, "stop": ["ok", 3]}, "stop[1]", ""),
    ({"messages": HI, "stop": ""}, "stop", "empty"),
    ({"messages": HI, "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"messages": HI, "logit_bias": {"10": 1000}}, "logit_bias", ""),
    ({"messages": HI, "logit_bias": {"99999999": 1}}, "logit_bias", "vocabulary"),
    ({"messages": HI, "top_logprobs": 3}, "top_logprobs", "logprobs"),
    ({"messages": HI, "min_tokens": 10, "max_tokens": 5}, "min_tokens", ""),
    ({"messages": HI, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", ""),
    ({"messages": HI, "response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
    ({"messages": []}, "messages", ""),
    ({}, "messages", "required"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "wizard"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]", "not supported"),
    ({"messages": HI, "max_tokens": 9000}, "max_tokens", "8192"),
])
def test_invalid_chat_parameters_are_400_naming_the_field(http: httpx.Client, body, param, text) -> None:
    assert_error(http.post("/v1/chat/completions", json=body), 400, param, text)


@pytest.mark.parametrize("body, param", [
    ({"prompt": [[1, 2], "a"]}, "prompt"),
    ({"prompt": [1, 2, 99999999]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": ["x"] * 1000}, "prompt"),
])
def test_invalid_completion_parameters(http: httpx.Client, body, param) -> None:
    err = assert_error(http.post("/v1/completions", json=body), 400)
    assert err["param"].startswith(param), err


@pytest.mark.parametrize("raw", [b"{bad json", b"[1, 2]", b'{"messages": NaN}', b'{"temperature": 1e999}',
                                 b"[" * 100_000, b"\xff\xfe", b""])
def test_malformed_bodies_are_400(http: httpx.Client, raw: bytes) -> None:
    assert_error(http.post("/v1/chat/completions", content=raw), 400)


def test_prompt_over_the_context_gives_both_numbers(http: httpx.Client) -> None:
    err = assert_error(http.post("/v1/completions", json={"prompt": "hello " * 9000}), 400, "prompt")
    n = http.post("/v1/tokenize", json={"prompt": "hello " * 9000}).json()["count"]
    assert n > 8192 and "8192" in err["message"] and str(n) in err["message"]
    assert err["code"] == "context_length_exceeded"
    # streaming requests are refused up front too, before any event is sent
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello " * 9000}],
                                                "stream": True})
    assert_error(r, 400, "messages", "8192")


def test_other_model_is_421(http: httpx.Client, smollm2_server) -> None:
    err = assert_error(http.post("/v1/chat/completions", json={"model": "llama3", "messages": HI}), 421, "model")
    assert "smollm2" in err["message"] and "llama3" in err["message"]
    client = openai.OpenAI(base_url=smollm2_server.base_url, api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="llama3", prompt="x")
    assert info.value.status_code == 421


def test_api_key_required_but_probes_stay_open(smollm2_server) -> None:
    url = smollm2_server.url
    assert_error(httpx.get(f"{url}/v1/models"), 401, text="API key")
    assert_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.get(f"{url}/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
    for path in ("/health", "/liveness", "/readiness", "/version", "/metrics"):
        assert httpx.get(f"{url}{path}").status_code == 200, path
    client = openai.OpenAI(base_url=smollm2_server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="smollm2", messages=HI)


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing"), 404, text="/v1/nothing")
    assert_error(http.post("/v2/chat/completions", json={}), 404)
    assert_error(http.get("/v1/chat/completions"), 405)


def test_embeddings_on_a_generative_model(http: httpx.Client) -> None:
    assert_error(http.post("/v1/embeddings", json={"input": "x", "model": "smollm2"}), 400, "model", "embeddings")


def test_body_over_the_limit_is_413(http: httpx.Client) -> None:
    # the default limit is 32 MiB: room for a 20 MiB image as base64
    big = b'{"prompt": "' + b"a" * (33 << 20) + b'"}'
    assert_error(http.post("/v1/completions", content=big), 413, text="limit")

    def chunks():  # no Content-Length: the limit is enforced while the body streams in
        for _ in range(33):
            yield b" " * (1 << 20)
    assert_error(http.post("/v1/completions", content=chunks()), 413)


def test_server_still_answers_after_all_that(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
