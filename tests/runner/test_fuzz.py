"""schemathesis against the daemon's own /openapi.json (issue 15, "make the classes impossible"): every route, a
bounded number of generated requests each (valid and invalid bodies), against a real `runlm serve`. No answer may
be a 5xx, and every error must have the documented shape (Ollama's {"error": "..."} under /api, else OpenAI's)."""
from __future__ import annotations

import pytest
import schemathesis

from runlm.apis.anthropic_output import is_anthropic_path
from runlm.store import ModelStore
from tests.fuzz import fuzz
from tests.runner.daemon import Daemon

EXAMPLES_PER_ROUTE = 6


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("fuzz-home")
    ModelStore(home).pull("tinycoder")
    # no hub: generated sources that look like Hugging Face ids fail at once instead of going out
    d = Daemon(home, env={"HF_HUB_OFFLINE": "1"}).start()
    yield d
    d.stop()


def error_shape(ctx, response, case) -> None:  # type: ignore[no-untyped-def]
    if response.status_code < 400:
        return
    err = response.json()["error"]
    if case.path.startswith("/api/"):
        assert isinstance(err, str) and err, response.text[:300]
    elif is_anthropic_path(case.path):
        assert response.json()["type"] == "error" and set(err) == {"type", "message"} and err["message"]
    else:
        assert set(err) == {"message", "type", "param", "code"} and err["message"], response.text[:300]


def test_no_request_gets_a_5xx_or_an_unshaped_error(fuzz_daemon: Daemon) -> None:
    schema = schemathesis.openapi.from_dict(fuzz_daemon.http.get("/openapi.json").json())
    schema.config.update(base_url=fuzz_daemon.url)
    report = fuzz(schema, EXAMPLES_PER_ROUTE, [error_shape])
    print(f"schemathesis (daemon): {report.summary()}")
    assert len(report.sent) >= 30
    assert not report.failures, "\n\n".join(report.failures)
    assert fuzz_daemon.http.get("/api/tags").status_code == 200


def test_docs_and_schema_name_the_request_models(fuzz_daemon: Daemon) -> None:
    doc = fuzz_daemon.http.get("/openapi.json").json()
    create = doc["paths"]["/models/create"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert create["$ref"].endswith("/CreateRequest") and "from" in doc["components"]["schemas"]["CreateRequest"][
        "properties"]
    assert doc["paths"]["/api/chat"]["post"]["responses"]["4XX"]["content"]["application/json"]["schema"][
        "$ref"].endswith("/OllamaError")
    assert "Swagger UI" in fuzz_daemon.http.get("/docs").text


def test_the_request_models_are_what_handlers_check(fuzz_daemon: Daemon) -> None:
    r = fuzz_daemon.http.post("/engines/unload", json={"models": "tinycoder"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "models"
    r = fuzz_daemon.http.post("/api/generate", json={"model": 7, "prompt": "a"})
    assert r.status_code == 400 and "model" in r.json()["error"]
