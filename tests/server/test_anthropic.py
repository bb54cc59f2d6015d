"""Anthropic's Messages API on serve-engine (smollm2), driven by the official ``anthropic`` client: whole and
streamed answers agree, stop sequences and max_tokens say why they stopped, tools go round, errors and auth
are Anthropic's."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.server.conftest import API_KEY

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "additionalProperties": False, "required": ["city"],
                            "properties": {"city": {"type": "string", "maxLength": 20}}}}
GREEDY = {"temperature": 0}  # the client no longer types temperature; the API (and this server) still takes it
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(smollm2_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=smollm2_server.url, api_key=API_KEY, max_retries=0, timeout=600)


def test_text_whole_and_streamed_agree(client: anthropic.Anthropic) -> None:
    body = dict(model="smollm2", system="Answer briefly.", messages=ASK, max_tokens=10, extra_body=GREEDY)
    whole = client.messages.create(**body)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "smollm2"
    assert whole.content[0].type == "text" and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.input_tokens > 5
    names, started = [], None
    with client.messages.stream(**body) as stream:
        for e in stream:
            names.append(e.type)
            if e.type == "message_start":
                started = e.message.usage
        final = stream.get_final_message()
    assert names[0] == "message_start" and names[-1] == "message_stop"
    # the prompt is counted before any output: message_start says so, as Anthropic's does
    assert started is not None and started.input_tokens == whole.usage.input_tokens and started.output_tokens == 0
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(names)
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_stop_reasons(client: anthropic.Anthropic) -> None:
    cut = client.messages.create(model="smollm2", messages=[{"role": "user", "content": "Tell a long story."}],
                                 max_tokens=3, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    text = client.messages.create(model="smollm2", messages=ASK, max_tokens=20, extra_body=GREEDY).content[0].text
    word = text.split()[1]  # a word the answer is known to contain, as a stop sequence
    stopped = client.messages.create(model="smollm2", messages=ASK, max_tokens=20, extra_body=GREEDY,
                                     stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text


def test_tool_use_and_result(client: anthropic.Anthropic) -> None:
    body = dict(model="smollm2", max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
                tool_choice={"type": "tool", "name": "get_weather"},
                messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    msg = client.messages.create(**body)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and [u.name for u in uses] == ["get_weather"]
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    with client.messages.stream(**body) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(uses[0].name, uses[0].input)]
    follow = dict(model="smollm2", max_tokens=20, extra_body=GREEDY, tools=[WEATHER], messages=[
        body["messages"][0], {"role": "assistant", "content": [u.model_dump() for u in uses]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "21 degrees"}]}])
    answer = client.messages.create(**follow)
    assert answer.content and answer.usage.input_tokens > msg.usage.input_tokens
    counted = client.messages.count_tokens(**{k: v for k, v in follow.items() if k in ("model", "messages", "tools")})
    assert counted.input_tokens == answer.usage.input_tokens


def test_output_config_json_schema(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}
    msg = client.messages.create(model="smollm2", max_tokens=60, extra_body=GREEDY,
                                 messages=[{"role": "user", "content": "Make up a person."}],
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(msg.content[0].text), schema)


def test_errors_and_auth_are_anthropics(client: anthropic.Anthropic, smollm2_server) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="smollm2", messages=ASK, max_tokens=-1)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model="smollm2", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    r = httpx.post(f"{smollm2_server.url}/v1/messages", json={"model": "smollm2", "messages": ASK},
                   headers={"x-api-key": API_KEY})
    assert r.status_code == 400 and "max_tokens is required" in r.json()["error"]["message"]
    bad = anthropic.Anthropic(base_url=smollm2_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(model="smollm2", messages=ASK, max_tokens=2)
    assert err.value.body["error"]["type"] == "authentication_error"


def test_raw_stream_names_each_event_and_the_served_model(smollm2_server) -> None:
    body = {"messages": ASK, "max_tokens": 3, "stream": True, "temperature": 0}  # no model: the served one
    with httpx.stream("POST", f"{smollm2_server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    events = []
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[6:])
        assert payload["type"] == name[7:]
        events.append(payload)
    assert events[0]["message"]["model"] == "smollm2"
    assert [e["type"] for e in events][-2:] == ["message_delta", "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "max_tokens" and events[-2]["usage"]["output_tokens"] == 3
