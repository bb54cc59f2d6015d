"""Ollama's ``think`` through the official ollama client and the daemon: a generated Qwen3 model with Qwen3's
chat template, its thinking opened by a prefilled answer (Ollama continues a final assistant message)."""
from __future__ import annotations

from collections.abc import Iterator

import ollama
import pytest

from runlm.store import ModelStore
from tests.fixtures.models import qwen3_thinking_model
from tests.runner.daemon import Daemon

ASK = [{"role": "user", "content": "What is the capital of France?"}]
PREFILL = ASK + [{"role": "assistant", "content": "<think>\nThe user asks"}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ollama.Client]:
    home = tmp_path_factory.mktemp("runlm-home")
    ModelStore(home).pull(str(qwen3_thinking_model()), name="qwen3-think")
    d = Daemon(home).start()
    yield ollama.Client(host=d.url)
    d.stop()


def test_chat_thinking_goes_to_message_thinking_whole_and_streamed(client: ollama.Client) -> None:
    whole = client.chat(model="qwen3-think", messages=PREFILL, think=True, options=GREEDY)
    assert whole.message.thinking and "think>" not in whole.message.thinking
    assert not whole.message.content  # nothing closed the thinking within num_predict
    parts = list(client.chat(model="qwen3-think", messages=PREFILL, think=True, options=GREEDY, stream=True))
    assert sum(bool(p.message.thinking) for p in parts) > 1
    assert "".join(p.message.thinking or "" for p in parts) == whole.message.thinking
    assert client.chat(model="qwen3-think", messages=PREFILL, think="low", options=GREEDY).message.thinking


def test_think_false_turns_thinking_off_in_the_template(client: ollama.Client) -> None:
    r = client.chat(model="qwen3-think", messages=ASK, think=False, options=GREEDY)
    assert r.message.content and not r.message.thinking
    g = client.generate(model="qwen3-think", prompt=ASK[0]["content"], think=False, options=GREEDY)
    assert g.response and not g.thinking
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="qwen3-think", messages=ASK, think="very", options=GREEDY)
    assert err.value.status_code == 400
