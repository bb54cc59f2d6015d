"""OpenAI's Responses API on serve-engine (smollm2), driven by the official ``openai`` client: whole and streamed
answers agree, tools and structured outputs come through the chat path, stored responses chain and delete."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 20}}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}


@pytest.fixture(scope="module")
def client(smollm2_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_server.base_url, api_key=API_KEY, max_retries=0, timeout=600)


def test_text_whole_and_streamed_agree(client: openai.OpenAI) -> None:
    body = dict(model="smollm2", instructions="Answer briefly.", input="What is the capital of France?",
                temperature=0, max_output_tokens=12)
    whole = client.responses.create(**body)
    assert whole.object == "response" and whole.model == "smollm2" and whole.id.startswith("resp_")
    assert whole.output_text and whole.output[0].type == "message"
    assert whole.usage.output_tokens <= 12 and whole.usage.input_tokens > 5
    assert whole.status in ("completed", "incomplete")
    kinds, text, final = [], "", None
    for e in client.responses.create(stream=True, **body):
        kinds.append(e.type)
        if e.type == "response.output_text.delta":
            text += e.delta
        if e.type in ("response.completed", "response.incomplete"):
            final = e.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert text == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_length_limit_is_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(model="smollm2", input="Write a long story about a dragon.", max_output_tokens=3,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_forced_function_call_whole_and_streamed(client: openai.OpenAI) -> None:
    body = dict(model="smollm2", input="What is the weather in Paris?", tools=[WEATHER],
                tool_choice={"type": "function", "name": "get_weather"}, temperature=0, max_output_tokens=60)
    whole = client.responses.create(**body)
    calls = [o for o in whole.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"] and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    args, done = "", None
    for e in client.responses.create(stream=True, **body):
        if e.type == "response.function_call_arguments.delta":
            args += e.delta
        if e.type == "response.completed":
            done = e.response
    streamed = [o for o in done.output if o.type == "function_call"]
    assert args == streamed[0].arguments == calls[0].arguments
    # the call's output goes back in as an input item, after the call itself
    follow = client.responses.create(model="smollm2", tools=[WEATHER], temperature=0, max_output_tokens=20, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature": 21}'}])
    assert follow.output and follow.usage.input_tokens > whole.usage.input_tokens


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    r = client.responses.create(model="smollm2", input="Make up a person.", temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), PERSON)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="smollm2", input="x", text={"format": {"type": "json_schema", "name": "p",
                                                                             "schema": {"type": "nope"}}})
    assert err.value.body["param"].startswith("text.format")


def test_previous_response_id_retrieve_and_delete(client: openai.OpenAI) -> None:
    first = client.responses.create(model="smollm2", input="My name is Zork. Say hello.", temperature=0,
                                    max_output_tokens=8)
    second = client.responses.create(model="smollm2", input="What is my name?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=8)
    # the second prompt holds the first turn: its input is longer than the question alone
    alone = client.responses.create(model="smollm2", input="What is my name?", temperature=0, max_output_tokens=8,
                                    store=False)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(alone.id)  # store=false keeps nothing
    deleted = client.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="smollm2", input="again", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"


def test_bad_input_is_a_named_400(client: openai.OpenAI) -> None:
    for body, param in [(dict(input=[{"type": "input_image_call"}]), "input[0].type"),
                        (dict(input="x", tools=[{"type": "web_search"}]), "tools[0]"),
                        (dict(input="x", max_output_tokens=-1), "max_output_tokens"),
                        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                         "input[0].content[0]")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model="smollm2", **body)
        assert err.value.body["param"] == param, err.value.body


def test_serve_engine_cannot_delete_its_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        client.models.delete("smollm2")
    assert err.value.status_code == 405 and "cannot delete" in err.value.body["message"]


@pytest.mark.parametrize("path,body", [
    ("/v1/responses", {"input": "Write a very long story about a dragon.", "max_output_tokens": 2000}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Write a very long story."}], "max_tokens": 2000})],
    ids=["responses", "messages"])
def test_a_stream_the_client_leaves_is_aborted(smollm2_server, path: str, body: dict) -> None:
    from tests.server.test_load import metrics, wait_idle
    before = metrics(smollm2_server)["runlm:generation_tokens_total"]
    with httpx.stream("POST", f"{smollm2_server.url}{path}", json={**body, "stream": True, "ignore_eos": True},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
        lines = r.iter_lines()
        while "delta" not in next(lines):  # text is flowing
            pass
    # the engine request is gone within moments, long before its 2000 tokens
    after = wait_idle(smollm2_server, timeout=10)
    assert after["runlm:generation_tokens_total"] - before < 1000


def test_input_items_are_listed_and_paged(client: openai.OpenAI) -> None:
    items = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."},
             {"role": "assistant", "content": "Blue."}, {"role": "user", "content": [
                 {"type": "input_text", "text": "Another one?"}]}]
    r = client.responses.create(model="smollm2", input=items, temperature=0, max_output_tokens=4)
    listed = client.responses.input_items.list(r.id, order="asc")
    assert [(i.type, i.role) for i in listed.data] == [("message", "system"), ("message", "user"),
                                                       ("message", "assistant"), ("message", "user")]
    assert listed.data[1].content[0].type == "input_text" and listed.data[1].content[0].text == "Name a colour."
    assert listed.data[2].content[0].type == "output_text" and listed.data[2].content[0].text == "Blue."
    assert not listed.has_more and listed.first_id == listed.data[0].id and listed.last_id == listed.data[-1].id
    ids = [i.id for i in listed.data]
    assert len(set(ids)) == 4
    newest = client.responses.input_items.list(r.id, limit=3)  # OpenAI's default order: newest first
    assert [i.id for i in newest.data] == ids[::-1][:3] and newest.has_more
    rest = client.responses.input_items.list(r.id, limit=3, after=newest.last_id)
    assert [i.id for i in rest.data] == ids[:1] and not rest.has_more
    assert [i.id for i in client.responses.input_items.list(r.id, order="asc")] == ids  # the client pages on
    # a string input is one user message; a function call and its output keep their call id
    assert [i.role for i in client.responses.input_items.list(
        client.responses.create(model="smollm2", input="Hi", max_output_tokens=2).id).data] == ["user"]
    call = client.responses.create(model="smollm2", max_output_tokens=2, input=[
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    kinds = client.responses.input_items.list(call.id, order="asc").data
    assert [k.type for k in kinds] == ["message", "function_call", "function_call_output"]
    assert kinds[1].call_id == kinds[2].call_id == "c1" and kinds[2].output == "sunny"
    for bad in ({"limit": 0}, {"limit": 101}, {"order": "sideways"}, {"after": "msg_nope"}):
        with pytest.raises(openai.APIStatusError) as err:
            client.responses.input_items.list(r.id, **bad)  # type: ignore[arg-type]
        assert err.value.status_code in (400, 404) and err.value.body["param"] == next(iter(bad))
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
