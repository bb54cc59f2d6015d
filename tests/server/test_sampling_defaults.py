"""A model directory's generation_config.json sets what requests leave out, on every route (chat, completions,
Responses, Anthropic), and a request's own fields win. Real serve-engine process, official clients."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import anthropic
import openai
import pytest

from tests.fixtures.models import build_model
from tests.server.process import ServerProcess

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = tmp_path_factory.mktemp("gencfg") / "model"
    shutil.copytree(build_model("llama"), model)
    config = json.loads((model / "generation_config.json").read_text())
    # greedy, and 5 new tokens unless a request says otherwise
    config.update(do_sample=False, temperature=0.0, max_new_tokens=5)
    (model / "generation_config.json").write_text(json.dumps(config))
    proc = ServerProcess(str(model), ["--kv-cache-memory", "64MiB", "--served-model-name", "m"]).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


def test_the_model_defaults_are_logged(server: ServerProcess) -> None:
    assert any("sampling defaults" in line and "'max_tokens': 5" in line for line in server.log), server.log


def test_max_new_tokens_is_every_routes_default(client: openai.OpenAI, server: ServerProcess) -> None:
    chat = client.chat.completions.create(model="m", messages=MESSAGES, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
    text = client.completions.create(model="m", prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert text.usage.completion_tokens == 5  # not OpenAI's 16
    resp = client.responses.create(model="m", input="Tell me a story.")
    assert resp.usage.output_tokens == 5 and resp.status == "incomplete"
    # a request's own limit wins
    assert client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3,
                                          extra_body={"ignore_eos": True}).usage.completion_tokens == 3
    assert client.responses.create(model="m", input="Hi", max_output_tokens=16).usage.output_tokens == 16
    a = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    assert a.messages.create(model="m", max_tokens=4, messages=MESSAGES).usage.output_tokens == 4


def test_temperature_zero_is_the_default_and_a_request_overrides_it(client: openai.OpenAI) -> None:
    def text(**kw: object) -> str:
        r = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, extra_body={"ignore_eos": True},
                                           **kw)  # type: ignore[call-overload]
        return r.choices[0].message.content or ""

    greedy = {text(seed=s) for s in range(3)}
    assert len(greedy) == 1  # the model's temperature 0: seeds change nothing
    assert greedy == {text(seed=9, temperature=0.0)}
    sampled = {text(seed=s, temperature=1.0) for s in range(3)}
    assert len(sampled) > 1  # the request's temperature wins: the seeds now matter
