"""Tool calling with the official ``openai`` client against a real server (smollm2): forced calls are
valid JSON for their schema, streamed deltas reassemble to the whole answer, results go back in."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["tz"],
                   "properties": {"tz": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}}}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "system", "content": "You are a helpful assistant with tools."},
       {"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client(smollm2_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_server.base_url, api_key=API_KEY, max_retries=0, timeout=600)


def _valid(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _reassemble(stream) -> tuple[str, list[dict], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id is not None:
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                calls[d.index]["arguments"] += d.function.arguments
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_calls_are_valid_and_stream_to_the_same_result(client: openai.OpenAI, tool_choice) -> None:
    body = dict(model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=0,
                max_tokens=120)
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "tool_calls" and not whole.message.content
    _valid(whole.message.tool_calls)
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in whole.message.tool_calls] == ["get_weather"]
    content, calls, finish = _reassemble(client.chat.completions.create(stream=True, **body))
    assert finish == "tool_calls" and not content
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                            for c in whole.message.tool_calls]


def test_tool_results_go_back_into_the_conversation(client: openai.OpenAI, smollm2_server) -> None:
    first = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=80).choices[0].message
    call = first.tool_calls[0]
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    # the rendered prompt holds the call and its result (SmolLM2's template knows no tools: runlm's Hermes prompt)
    import httpx
    r = httpx.post(f"{smollm2_server.url}/v1/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"messages": history, "tools": [WEATHER], "return_token_strs": True})
    assert r.status_code == 200, r.text
    prompt = "".join(r.json()["token_strs"])
    assert "get_weather" in prompt and "tool_response" in prompt and "temperature" in prompt
    answer = client.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=40).choices[0]
    assert answer.message.content and not answer.message.tool_calls and answer.finish_reason in ("stop", "length")


def test_auto_answers_in_text_or_calls_and_none_never_calls(client: openai.OpenAI) -> None:
    auto = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], temperature=0,
                                          max_tokens=60).choices[0]
    if auto.message.tool_calls:
        assert auto.finish_reason == "tool_calls"
        assert all(c.function.name == "get_weather" for c in auto.message.tool_calls)
    else:
        assert auto.message.content and auto.finish_reason in ("stop", "length")
    none = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="none",
                                          temperature=0, max_tokens=20).choices[0]
    assert not none.message.tool_calls and none.message.content


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tools_are_400s(client: openai.OpenAI, body, param) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4, **body)
    assert err.value.body["param"] == param
