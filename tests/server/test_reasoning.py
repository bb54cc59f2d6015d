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


def test_anthropic_messages_give_thinking_blocks_whole_and_streamed(server) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    body = dict(model="qwen3", max_tokens=20, extra_body={"temperature": 0}, thinking={"type": "enabled", "budget_tokens": 6},
                messages=[{"role": "user", "content": ASK[0]["content"]},
                          {"role": "assistant", "content": PREFILL[-1]["content"]}])
    whole = client.messages.create(**body)
    kinds = [b.type for b in whole.content]
    assert kinds == ["thinking", "text"], kinds
    assert whole.content[0].thinking and "think>" not in whole.content[0].thinking
    assert "think>" not in whole.content[1].text
    thinking_deltas = []
    with client.messages.stream(**body) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                thinking_deltas.append(event.delta.thinking)
        final = stream.get_final_message()
    assert len(thinking_deltas) > 1  # streamed as it is written
    assert [b.type for b in final.content] == kinds
    assert final.content[0].thinking == "".join(thinking_deltas) == whole.content[0].thinking
    assert final.content[1].text == whole.content[1].text


def test_responses_give_a_reasoning_item_whole_and_streamed(client: openai.OpenAI) -> None:
    body = dict(model="qwen3", input=PREFILL, temperature=0, max_output_tokens=20, extra_body=THINK)
    whole = client.responses.create(**body)
    kinds = [item.type for item in whole.output]
    assert kinds == ["reasoning", "message"], kinds
    thinking = whole.output[0].content[0].text
    assert thinking and "think>" not in thinking and "think>" not in whole.output_text
    deltas, final = [], None
    for event in client.responses.create(stream=True, **body):
        if event.type == "response.reasoning_text.delta":
            deltas.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert len(deltas) > 1 and "".join(deltas) == thinking
    assert final is not None and [item.type for item in final.output] == kinds
    assert final.output[0].content[0].text == thinking and final.output_text == whole.output_text
