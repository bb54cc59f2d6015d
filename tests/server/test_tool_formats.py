"""The 2025-2026 tool-call and reasoning formats end to end through the official ``openai`` client: a generated
model whose chat template teaches the format (Qwen3-Coder's XML; gpt-oss's harmony channels), its output forced into
that format the honest way a random model allows (a ``structured_outputs`` regex), read back as ``tool_calls`` (and
``reasoning``) whole and streamed, the parameters typed by the tools' schemas."""
from __future__ import annotations

import json
import re

import openai
import pytest

from tests.fixtures.models import templated_model
from tests.server.process import ServerProcess

# the shapes of the real templates, as far as format detection and a conversation need them
QWEN3_CODER = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
               "{% if tools %}Call a function as <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n"
               "</function>\n</tool_call>{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GPT_OSS = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
           "{% if tools %}<|start|>developer<|message|>call as <|channel|>commentary to=functions.NAME<|end|>"
           "{% endif %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n</tool_call>")
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant to=functions.get_weather"
                '<|channel|>commentary json<|message|>{"city": "Paris", "days": 3}')


@pytest.fixture(scope="module", params=["qwen3-coder", "gpt-oss"])
def served(request):
    template = QWEN3_CODER if request.param == "qwen3-coder" else GPT_OSS
    s = ServerProcess(str(templated_model(f"{request.param}-template", template)),
                      ["--served-model-name", "m", "--kv-cache-memory", "64MiB"]).start()
    yield request.param, openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0, timeout=300)
    s.stop()


def test_calls_in_the_templates_format_come_back_whole_and_streamed(served) -> None:
    kind, client = served
    forced = XML_CALL if kind == "qwen3-coder" else HARMONY_CALL
    body = dict(model="m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=120,
                extra_body={"structured_outputs": {"regex": re.escape(forced)}})
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "tool_calls" and not whole.message.content
    [call] = whole.message.tool_calls
    expected = {"city": "Paris", "days": 3, "zip": "75001"} if kind == "qwen3-coder" else {"city": "Paris", "days": 3}
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == expected
    reasoning = whole.message.model_extra.get("reasoning_content")
    assert reasoning == ("Need the weather tool." if kind == "gpt-oss" else None)
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
