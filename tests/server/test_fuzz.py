"""schemathesis against serve-engine's own /openapi.json (issue 15, "make the classes impossible"): every route,
a bounded number of generated requests each (valid and invalid bodies), against a real server process. No
answer may be a 5xx, and every error must have OpenAI's shape. The model is tiny and its context 64 tokens, so
any generation the fuzzer asks for is short."""
from __future__ import annotations

import httpx
import pytest
import schemathesis

from runlm.apis.anthropic_output import is_anthropic_path
from tests.fuzz import fuzz
from tests.server.process import ServerProcess

EXAMPLES_PER_ROUTE = 12
KEY = {"Authorization": "Bearer fuzz-key"}


@pytest.fixture(scope="module")
def fuzz_server():
    server = ServerProcess("tinycoder", ["--max-model-len", "64", "--kv-cache-memory", "32MiB", "--api-key",
                                         "fuzz-key", "--max-num-seqs", "8"]).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def engine_schema(fuzz_server):
    doc = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(doc)
    schema.config.update(base_url=fuzz_server.url)
    return schema


def error_shape(ctx, response, case) -> None:  # type: ignore[no-untyped-def]
    """Every error is {"error": {"message", "type", "param", "code"}} with a message (Anthropic's on /v1/messages)."""
    if response.status_code < 400:
        return
    err = response.json()["error"]
    if is_anthropic_path(case.path):  # Anthropic's own shape on its routes
        assert response.json()["type"] == "error" and set(err) == {"type", "message"} and err["message"]
        return
    assert set(err) == {"message", "type", "param", "code"} and err["message"], response.text[:300]


def test_no_request_gets_a_5xx_or_an_unshaped_error(engine_schema) -> None:
    report = fuzz(engine_schema, EXAMPLES_PER_ROUTE, [error_shape], headers=KEY)
    print(f"schemathesis (serve-engine): {report.summary()}")
    assert len(report.sent) >= 15
    assert not report.failures, "\n\n".join(report.failures)
    assert report.statuses[200] >= 20  # valid requests were made and answered, not only refusals


def test_the_document_covers_every_route_and_its_request_model(fuzz_server) -> None:
    doc = httpx.get(f"{fuzz_server.url}/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize", "/v1/rerank"):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].rsplit("/", 1)[-1] in doc["components"]["schemas"], path
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "max_tokens", "temperature", "chat_template_kwargs"} <= set(chat["properties"])
    assert "Swagger UI" in httpx.get(f"{fuzz_server.url}/docs").text
