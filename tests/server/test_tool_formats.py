"""The 2025-2026 tool-call and reasoning formats end to end through the official ``openai`` and ``anthropic``
clients: a generated model whose chat template teaches the format (Qwen3-Coder's XML, gpt-oss's harmony channels,
GLM-4.5's argument tags, DeepSeek-V3's call tokens, Llama 3.2/4's pythonic lists), its output forced into that format
the honest way a random model allows (a ``structured_outputs`` regex; on Anthropic Messages runlm's extension of the
same name), read back as ``tool_calls`` / ``tool_use`` blocks (and ``reasoning``) whole and streamed, the parameters
typed by the tools' schemas."""
from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest

from tests.fixtures.default_run import default_run
from tests.fixtures.models import templated_model
from tests.fixtures.tool_formats import ASK, FORMATS, TOOLS
from tests.server.process import ServerProcess


@pytest.fixture(scope="module", params=list(FORMATS))
def served(request):
    s = ServerProcess(str(templated_model(f"{request.param}-template", FORMATS[request.param][0])),
                      ["--served-model-name", "m", "--kv-cache-memory", "64MiB"]).start()
    yield request.param, s
    s.stop()


@default_run("qwen3-coder", "gpt-oss")
def test_calls_in_the_templates_format_come_back_whole_and_streamed(served) -> None:
    kind, server = served
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
    _, forced, expected, reasoning = FORMATS[kind]
    body = dict(model="m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=200,
                extra_body={"structured_outputs": {"regex": re.escape(forced)}})
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "tool_calls" and not whole.message.content
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == expected
    assert whole.message.model_extra.get("reasoning_content") == reasoning
    calls, thinking, content = {}, "", ""
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            thinking += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                entry["arguments"] += d.function.arguments or ""
    assert not content.strip() and thinking == (reasoning or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", expected)]


def test_the_same_calls_come_back_as_anthropic_tool_use_blocks(served) -> None:
    kind, server = served
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    _, forced, expected, reasoning = FORMATS[kind]
    tool = TOOLS[0]["function"]
    body = dict(model="m", messages=ASK, max_tokens=200, tools=[{"name": tool["name"], "input_schema": tool["parameters"]}],
                extra_body={"temperature": 0, "structured_outputs": {"regex": re.escape(forced)}})
    msg = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        streamed = stream.get_final_message()
    for m in (msg, streamed):
        assert m.stop_reason == "tool_use"
        assert [(b.name, b.input) for b in m.content if b.type == "tool_use"] == [("get_weather", expected)]
        assert not "".join(b.text for b in m.content if b.type == "text").strip()
        thinking = "".join(b.thinking for b in m.content if b.type == "thinking")
        assert thinking in ("", reasoning)  # (thinking blocks where the client asks for them)
