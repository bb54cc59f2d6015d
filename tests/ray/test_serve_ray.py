"""runlm's OpenAI server as a Ray Serve application (runlm.serve.ray:app) on a real two-node Ray
cluster, answered through Serve's HTTP proxy by the official openai client, and scaled out by Serve's
autoscaler when its queue grows."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fixtures.ray_cluster import free_port

pytestmark = pytest.mark.slow
pytest.importorskip("ray", reason="Ray is not installed: pip install 'runlm[ray]' (make test-slow does)")
openai = pytest.importorskip("openai")

from pydantic import ValidationError  # noqa: E402
from ray import serve  # noqa: E402

from runlm.serve.ray import RayServeArgs, app  # noqa: E402


def test_arguments_are_checked() -> None:
    assert RayServeArgs.model_validate({"served_model_name": "a,b"}).served_model_name == ["a", "b"]
    with pytest.raises(ValidationError, match="extra"):
        RayServeArgs.model_validate({"model": "smollm2", "trust_remote_code": "true"})
    with pytest.raises(ValidationError, match="min_replicas"):
        RayServeArgs.model_validate({"min_replicas": 3, "max_replicas": 2})
    with pytest.raises(ValidationError):
        RayServeArgs.model_validate({"threads": 0})


def _replicas(name: str = "runlm") -> int:
    status = serve.status().applications["runlm"].deployments[name]
    return status.replica_states.get("RUNNING", 0)


def test_serve_app_answers_the_openai_client_and_scales_on_queue_depth(ray_cluster) -> None:
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "HeadOnly"})
    try:
        serve.run(app({"model": "tinycoder", "api_key": "sekret", "max_model_len": "512", "min_replicas": "1",
                       "max_replicas": "2", "target_ongoing_requests": "1", "upscale_delay_s": "1"}),
                  name="runlm", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="sekret", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tinycoder"]
        done = client.completions.create(model="tinycoder", prompt="def fibonacci(n):", max_tokens=6, temperature=0)
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 6
        chunks = client.chat.completions.create(model="tinycoder", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5, temperature=0, stream=True)
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
        # bad input: the engine's 400 in OpenAI's error shape, through Serve's proxy
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tinycoder", prompt="x", max_tokens=2, temperature=-1)
        assert err.value.body["param"] == "temperature"
        assert httpx.get(f"{base}/v1/models").status_code == 401  # the API key holds behind Serve

        # queue depth above target_ongoing_requests=1: Serve adds the second replica (on the other node)
        assert _replicas() == 1

        def one(i: int) -> str | None:
            out = client.completions.create(model="tinycoder", prompt=f"# {i}", max_tokens=200, temperature=0,
                                            extra_body={"ignore_eos": True})
            return out.choices[0].finish_reason

        deadline = time.monotonic() + 120
        with ThreadPoolExecutor(6) as pool:
            while _replicas() < 2 and time.monotonic() < deadline:
                assert list(pool.map(one, range(6))) == ["length"] * 6
        assert _replicas() == 2
    finally:
        serve.shutdown()
