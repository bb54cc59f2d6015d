"""Structured outputs over HTTP with the official ``openai`` client against a real server (smollm2):
every constrained answer that stops parses and validates; bad constraints are 400s naming the field."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests.fixtures.schemas import SCHEMAS
from tests.server.conftest import API_KEY

FAST = [1, 2, 12, 22, 23]  # short answers: the default run; all 30 run with -m slow


@pytest.fixture(scope="module")
def client(smollm2_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_server.base_url, api_key=API_KEY, max_retries=0, timeout=600)


def _check_all(server, indices: list[int], may_run_out: int = 0) -> None:
    """Every answer that stops parses and validates; at most ``may_run_out`` answers may instead use the whole
    token budget (the 135M model can loop inside a string the grammar allows), and those are still JSON's start."""
    async def one(c: openai.AsyncOpenAI, what: str, schema: dict):
        prompt = f"Give me {what} as JSON matching this schema: {json.dumps(schema)}"
        resp = await c.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=160,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        return resp.choices[0], resp.usage.completion_tokens

    async def run():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=900) as c:
            return await asyncio.gather(*(one(c, *SCHEMAS[i]) for i in indices))
    ran_out = []
    for i, (choice, used) in zip(indices, asyncio.run(run())):
        if choice.finish_reason == "length":
            assert used == 160 and choice.message.content.lstrip().startswith("{"), (i, choice.message.content)
            ran_out.append(i)
            continue
        assert choice.finish_reason == "stop", (i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[i][1],
                            format_checker=jsonschema.FormatChecker())
    assert len(ran_out) <= may_run_out, f"schemas {ran_out} ran out of tokens"


def test_a_few_schemas_validate(smollm2_server) -> None:
    _check_all(smollm2_server, FAST)


@pytest.mark.slow
def test_all_30_schemas_validate(smollm2_server) -> None:
    _check_all(smollm2_server, list(range(len(SCHEMAS))), may_run_out=2)


def test_json_object_regex_choice_grammar_on_chat_and_completions(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Describe a cat as a JSON object with a name and a colour."}]
    obj = client.chat.completions.create(model="smollm2", messages=ask, temperature=0, max_tokens=80,
                                         response_format={"type": "json_object"}).choices[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)
    else:  # cut short: still the start of an object
        assert obj.message.content.lstrip().startswith("{")
    phone = client.completions.create(model="smollm2", prompt="Call me at", max_tokens=20, temperature=0.7, seed=3,
                                      extra_body={"structured_outputs": {"regex": r" \(\d{3}\) \d{3}-\d{4}"}})
    assert re.fullmatch(r" \(\d{3}\) \d{3}-\d{4}", phone.choices[0].text)
    choice = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=5, messages=[
        {"role": "user", "content": "Is the sky green?"}], extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no")
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    got = client.completions.create(model="smollm2", prompt="Q: Is ice cold?\nA:", max_tokens=12, temperature=0,
                                    extra_body={"structured_outputs": {"grammar": gbnf}}).choices[0]
    assert got.finish_reason == "stop" and got.text in ("The answer is yes.", "The answer is no.")
    lark = 'start: "colour: " COLOUR\nCOLOUR: "red" | "blue"'
    got = client.completions.create(model="smollm2", prompt="A colour:", max_tokens=8, temperature=0,
                                    extra_body={"structured_outputs": {"grammar": lark}}).choices[0]
    assert got.text in ("colour: red", "colour: blue")


def test_streamed_constrained_output_equals_the_whole_one(client: openai.OpenAI) -> None:
    schema = SCHEMAS[28][1]  # a sentiment: no other properties allowed, so it ends soon
    body = dict(model="smollm2", messages=[{"role": "user", "content": "The sentiment of 'I love it' as JSON."}],
                temperature=0, max_tokens=80, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    whole = client.chat.completions.create(**body).choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(stream=True, **body)
                       if ch.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), schema)  # finished with stop: it parses and validates


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema", "frob"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema", "uniqueItems"),
    ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs.regex", "unclosed group"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= nothing"}}}, "structured_outputs.grammar",
     "nothing"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice", "non-empty"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs.choice",
     "exactly one"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, "guided_regex", "use one"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_are_400_naming_the_field(client: openai.OpenAI, body, param, words, stream) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       stream=stream, **body)
    error = err.value.body
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"
    ok = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.choices[0].message.content is not None  # the server is fine after it
