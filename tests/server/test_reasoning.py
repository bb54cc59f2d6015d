"""Reasoning models through the official ``openai`` client: a generated Qwen3 model with Qwen3's chat template
(tests/fixtures), its thinking forced the honest way a random model allows: the assistant's answer is
prefilled with ``<think>`` (continue_final_message) and a thinking budget closes it with ``</think>``, whose
tokens straddle stream chunks (the tokenizer writes each tag as three tokens)."""
from __future__ import annotations

import json

import openai
import pytest

from tests.fixtures.models import qwen3_thinking_model
from tests.server.process import ServerProcess

ASK = [{"role": "user", "content": "What is the capital of France?"}]
PREFILL = ASK + [{"role": "assistant", "content": "<think>\nThe user asks"}]
THINK = dict(add_generation_prompt=False, continue_final_message=True, thinking_token_budget=6, ignore_eos=True)


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(str(qwen3_thinking_model()), ["--served-model-name", "qwen3", "--kv-cache-memory", "64MiB"])
    yield s.start()
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


def _stream(client: openai.OpenAI, **body) -> tuple[str, str, list[str], str | None]:
    thinking, content, pieces, finish = "", "", [], None
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            d = choice.delta
            thinking += getattr(d, "reasoning_content", None) or ""
            assert (getattr(d, "reasoning", None) or "") == (getattr(d, "reasoning_content", None) or "")
            content += d.content or ""
            pieces += [getattr(d, "reasoning_content", None) or "", d.content or ""]
            finish = choice.finish_reason or finish
    return thinking, content, pieces, finish


def test_thinking_is_split_from_the_answer_whole_and_streamed(client: openai.OpenAI) -> None:
    body = dict(model="qwen3", messages=PREFILL, temperature=0, max_tokens=20, extra_body=THINK)
    whole = client.chat.completions.create(**body).choices[0].message
    reasoning = whole.model_extra["reasoning_content"]
    assert reasoning and whole.model_extra["reasoning"] == reasoning
    assert whole.content and "think>" not in whole.content and "think>" not in reasoning
    thinking, content, pieces, finish = _stream(client, **body)
    assert (thinking, content, finish) == (reasoning, whole.content, "length")
    assert not any("think>" in p for p in pieces)


def test_enable_thinking_false_reaches_the_template_and_all_is_content(client: openai.OpenAI) -> None:
    body = dict(model="qwen3", messages=ASK, temperature=0, max_tokens=8,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True})
    msg = client.chat.completions.create(**body).choices[0].message
    assert msg.content and msg.model_extra.get("reasoning_content") is None
    thinking, content, _, _ = _stream(client, **body)
    assert (thinking, content) == ("", msg.content)
    effort = dict(body, extra_body={"ignore_eos": True}, reasoning_effort="none")
    assert client.chat.completions.create(**effort).choices[0].message.content == msg.content


def test_include_reasoning_false_drops_the_thinking(client: openai.OpenAI) -> None:
    body = dict(model="qwen3", messages=PREFILL, temperature=0, max_tokens=20,
                extra_body={**THINK, "include_reasoning": False})
    msg = client.chat.completions.create(**body).choices[0].message
    assert msg.content and msg.model_extra.get("reasoning_content") is None
    assert _stream(client, **body)[:2] == ("", msg.content)


def test_structured_output_constrains_only_the_answer(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
              "additionalProperties": False}
    body = dict(model="qwen3", messages=PREFILL, temperature=0, max_tokens=60,
                response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
                extra_body=dict(THINK, ignore_eos=False))
    msg = client.chat.completions.create(**body).choices[0].message
    assert msg.model_extra["reasoning_content"] and not msg.model_extra["reasoning_content"].startswith("{")
    assert set(json.loads(msg.content)) == {"city"}
    thinking, content, _, _ = _stream(client, **body)
    assert (thinking, content) == (msg.model_extra["reasoning_content"], msg.content)


def test_tool_calls_after_thinking_still_parse(client: openai.OpenAI) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}}}
    body = dict(model="qwen3", messages=PREFILL, temperature=0, max_tokens=60, tools=[tool],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                extra_body=dict(THINK, ignore_eos=False))
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.message.model_extra["reasoning_content"]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == {"city"}


def test_without_a_budget_the_thinking_runs_to_max_tokens(client: openai.OpenAI) -> None:
    body = dict(model="qwen3", messages=PREFILL, temperature=0, max_tokens=12,
                extra_body={k: v for k, v in THINK.items() if k != "thinking_token_budget"})
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.message.model_extra["reasoning_content"] and not choice.message.content
    assert choice.finish_reason == "length"


def test_continue_final_message_needs_a_final_assistant_message(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(model="qwen3", messages=ASK, extra_body={"continue_final_message": True})
