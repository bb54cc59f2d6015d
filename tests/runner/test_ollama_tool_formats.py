"""The same tool-call and reasoning formats through the official ``ollama`` client and the daemon: Qwen3-Coder XML,
harmony, GLM-4.5, DeepSeek-V3 and pythonic calls come back as ``message.tool_calls`` (arguments as objects, typed by
the tools' schemas) and harmony's analysis channel as ``message.thinking``, whole and streamed. The output is forced
by runlm's ``structured_outputs`` extension, which the daemon's Ollama API takes as its chat completions do."""
from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import ollama
import pytest

from runlm.store import ModelStore
from tests.fixtures.models import templated_model
from tests.fixtures.tool_formats import ASK, FORMATS, TOOLS
from tests.runner.daemon import Daemon


class Forcing(ollama.Client):
    """The official client, its request bodies carrying runlm's ``structured_outputs`` (a regex) beside its own."""

    def __init__(self, host: str) -> None:
        super().__init__(host=host, timeout=300)
        self.regex: str | None = None

    def _request(self, cls: Any, *args: Any, stream: bool = False, **kwargs: Any) -> Any:
        if self.regex is not None:
            kwargs["json"] = {**kwargs["json"], "structured_outputs": {"regex": self.regex}}
        return super()._request(cls, *args, stream=stream, **kwargs)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Forcing]:
    home = tmp_path_factory.mktemp("runlm-home")
    store = ModelStore(home)
    for kind, (template, *_) in FORMATS.items():
        store.pull(str(templated_model(f"{kind}-template", template)), name=kind)
    d = Daemon(home).start()
    yield Forcing(d.url)
    d.stop()


# the merging of streamed calls is the same for every format: the default run takes XML and harmony (with its
# thinking), `make test-slow` the other three (tests/server/test_tool_formats.py reads all five every run)
@pytest.mark.parametrize("kind", [k if k in ("qwen3-coder", "gpt-oss") else pytest.param(k, marks=pytest.mark.slow)
                                  for k in FORMATS])
def test_calls_come_back_as_ollama_tool_calls_whole_and_streamed(client: Forcing, kind: str) -> None:
    _, forced, expected, reasoning = FORMATS[kind]
    client.regex = re.escape(forced)
    body = dict(model=kind, messages=ASK, tools=TOOLS, options={"temperature": 0, "num_predict": 200})
    whole = client.chat(**body).message
    assert [(c.function.name, dict(c.function.arguments)) for c in whole.tool_calls or []] == [("get_weather", expected)]
    assert not (whole.content or "").strip() and (whole.thinking or None) == reasoning
    calls, thinking, content = [], "", ""
    for part in client.chat(stream=True, **body):
        calls += part.message.tool_calls or []
        thinking += part.message.thinking or ""
        content += part.message.content or ""
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", expected)]
    assert not content.strip() and thinking == (reasoning or "")
