"""Answers shaped as OpenAI's and vLLM's (issue 31), through the official ``openai`` client against real servers:
the stream's finish chunk, messages without tool calls, forced tool calls (declared properties only, one call
when parallel_tool_calls is false, a call cut off by max_tokens), required tools under a Llama-3.1 style
template, over-long embeddings, continue_final_message, and logprobs that show greedy's pick as the top-1."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.process import ServerProcess

# the parameters declare no additionalProperties: only city and unit may be written all the same
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
# the shape of Llama 3.1's template for tools: a JSON {"name", "parameters"} answer, <|python_tag|>
LLAMA31 = ("{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
           "Respond with a JSON for a function call: {\"name\": function name, \"parameters\": dictionary of "
           "argument name and its value}.{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|eot_id|>{% endif %}"
           "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
           "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("smollm2", ["--kv-cache-memory", "256MiB", "--served-model-name", "smollm2",
                                  "--trust-request-chat-template"]).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)


def _stream(client: openai.OpenAI, **body) -> list:
    return [c for c in client.chat.completions.create(stream=True, **body) if c.choices]


def test_the_streams_finish_chunk_has_an_empty_delta(client: openai.OpenAI) -> None:
    chunks = _stream(client, model="smollm2", messages=ASK, max_tokens=8, temperature=0)
    last = chunks[-1].choices[0]
    assert last.finish_reason == "length"
    assert not last.delta.content and not last.delta.tool_calls
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks)  # the text came before


def test_a_message_without_tool_calls_has_no_tool_calls_field(client: openai.OpenAI, server) -> None:
    plain = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4, temperature=0)
    assert plain.choices[0].message.tool_calls is None  # absent, not []
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": ASK, "max_tokens": 4, "tools": [WEATHER], "tool_choice": "none"})
    assert "tool_calls" not in r.json()["choices"][0]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_calls_write_declared_properties_only_and_one_call_when_not_parallel(client, stream) -> None:
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        body = dict(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice=tool_choice, temperature=0,
                    max_tokens=100, parallel_tool_calls=False)
        if stream:
            calls: dict[int, dict] = {}
            finish = None
            for c in _stream(client, **body):
                finish = c.choices[0].finish_reason or finish
                for d in c.choices[0].delta.tool_calls or []:
                    entry = calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                    entry["arguments"] += d.function.arguments or ""
            found = [(v["name"], v["arguments"]) for _, v in sorted(calls.items())]
        else:
            choice = client.chat.completions.create(**body).choices[0]
            finish = choice.finish_reason
            assert not choice.message.content
            found = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert finish == "tool_calls" and len(found) == 1, found
        name, arguments = found[0]
        assert name == "get_weather" and set(json.loads(arguments)) <= {"city", "unit"}


@pytest.mark.parametrize("tool_choice, max_tokens", [
    ("required", 16), ({"type": "function", "function": {"name": "get_weather"}}, 6)], ids=["required", "named"])
def test_a_call_cut_off_by_max_tokens_is_still_a_tool_call(client: openai.OpenAI, tool_choice, max_tokens) -> None:
    body = dict(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice=tool_choice, temperature=0,
                max_tokens=max_tokens)  # past the function's name, before the arguments close
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    chunks = _stream(client, **body)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert [d.function.name for c in chunks for d in c.choices[0].delta.tool_calls or [] if d.id] == ["get_weather"]


def test_required_with_a_llama31_template_answers_in_tool_calls(client: openai.OpenAI) -> None:
    """smollm2 repeats the call while parallel calls are allowed until max_tokens: still tool calls, never a
    JSON list in content; with parallel_tool_calls false the one call closes the answer."""
    for stream in (False, True):
        for parallel in (None, False):
            body = dict(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
                        max_tokens=100, extra_body={"chat_template_kwargs": {"chat_template": LLAMA31}},
                        **({"parallel_tool_calls": parallel} if parallel is not None else {}))
            if stream:
                chunks = _stream(client, **body)
                assert not "".join(c.choices[0].delta.content or "" for c in chunks)
                names = [d.function.name for c in chunks for d in c.choices[0].delta.tool_calls or [] if d.id]
                finish = chunks[-1].choices[0].finish_reason
            else:
                choice = client.chat.completions.create(**body).choices[0]
                assert choice.message.content is None, choice
                names, finish = [c.function.name for c in choice.message.tool_calls], choice.finish_reason
            assert names and set(names) == {"get_weather"}
            assert (finish, len(names)) == ("tool_calls", 1) if parallel is False else finish in ("tool_calls",
                                                                                                   "length")


def test_continue_final_message_with_add_generation_prompt_is_refused(client: openai.OpenAI) -> None:
    prefill = ASK + [{"role": "assistant", "content": "The weather in Paris is"}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2", messages=prefill, max_tokens=4,
                                       extra_body={"continue_final_message": True})  # add_generation_prompt: true
    assert err.value.body["param"] == "continue_final_message"
    ok = client.chat.completions.create(model="smollm2", messages=prefill, max_tokens=4, temperature=0,
                                        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert ok.choices[0].message.content


def test_greedy_answers_plainly_and_its_pick_is_the_top_logprob(client: openai.OpenAI) -> None:
    """The server's defaults are smollm2's (temperature 0.2, top_p 0.9, DRY over the output); the request asks for
    greedy. The old default repetition penalty pushed "Paris" away and showed a pick that was not the top-1."""
    out = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        temperature=0, max_tokens=12, logprobs=True, top_logprobs=3).choices[0]
    assert "Paris" in out.message.content
    for entry in out.logprobs.content:
        assert entry.logprob >= max(t.logprob for t in entry.top_logprobs) - 1e-5  # raw_logprobs: the model's


def test_processed_logprobs_on_request(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="smollm2", messages=ASK, temperature=0, max_tokens=3, logprobs=True, top_logprobs=2,
        logit_bias={"28": 40}, extra_body={"logprobs_mode": "processed_logprobs"}).choices[0]
    assert all(e.logprob > -0.01 for e in out.logprobs.content)  # the bias is in what is shown
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=1,
                                       extra_body={"logprobs_mode": "raw_logits"})


@pytest.fixture(scope="module")
def minilm():
    s = ServerProcess("minilm").start()
    yield openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
    s.stop()


def test_an_over_long_embedding_input_is_refused_unless_truncation_is_asked(minilm: openai.OpenAI) -> None:
    long = "word " * 3000
    with pytest.raises(openai.BadRequestError) as err:
        minilm.embeddings.create(model="minilm", input=long)
    assert "truncate_prompt_tokens" in err.value.message
    for truncate in (-1, 100):
        out = minilm.embeddings.create(model="minilm", input=long, extra_body={"truncate_prompt_tokens": truncate})
        assert len(out.data[0].embedding) == 384 and out.usage.prompt_tokens <= 512
    assert minilm.embeddings.create(model="minilm", input="short").data[0].embedding
