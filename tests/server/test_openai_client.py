"""The official ``openai`` client against a real serve-engine process (smollm2): sync and async,
streaming and not; the shapes it parses are OpenAI's."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY

CHAT = [{"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(smollm2_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def aclient(smollm2_server):
    """A factory: an async client belongs to the event loop it first runs on."""
    return lambda: openai.AsyncOpenAI(base_url=smollm2_server.base_url, api_key=API_KEY, max_retries=0,
                                      timeout=120)


def count_tokens(server, **body) -> int:
    r = httpx.post(f"{server.url}/v1/tokenize", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2", "smollm2:latest"]
    assert models.data[0].object == "model" and models.data[0].owned_by == "runlm"
    assert client.models.retrieve("smollm2:latest").id == "smollm2:latest"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_answers_and_counts_tokens_exactly(client: openai.OpenAI, smollm2_server) -> None:
    resp = client.chat.completions.create(model="smollm2", messages=CHAT, temperature=0, max_tokens=24,
                                          logprobs=True, top_logprobs=3)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-") and resp.model == "smollm2"
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    # usage is exact: the prompt as the chat template renders it, one logprob entry per generated token
    assert resp.usage.prompt_tokens == count_tokens(smollm2_server, messages=CHAT)
    assert resp.usage.completion_tokens == len(choice.logprobs.content) <= 24
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    # the end-of-turn token counts as generated, as in vLLM; its logprob entry comes last
    joined = "".join(t.token for t in choice.logprobs.content)
    assert joined.removesuffix("<|im_end|>") == choice.message.content
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_stream_matches_whole_answer(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="smollm2", messages=CHAT, temperature=0, max_tokens=12)
    chunks = list(client.chat.completions.create(model="smollm2", messages=CHAT, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=3, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason is not None


def test_async_client_streams_n_choices_concurrently(aclient) -> None:
    async def one(client: openai.AsyncOpenAI, seed: int) -> dict[int, str]:
        stream = await client.chat.completions.create(
            model="smollm2:latest", messages=[{"role": "user", "content": "Tell me a story."}], n=2, seed=seed,
            temperature=1.0, max_completion_tokens=6, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        texts: dict[int, str] = {0: "", 1: ""}
        usage = None
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
            usage = chunk.usage or usage
        assert usage.completion_tokens == 12  # two choices of exactly six tokens
        return texts

    async def main():
        client = aclient()
        return await asyncio.gather(one(client, 7), one(client, 7), one(client, 8))
    a, b, c = asyncio.run(main())
    assert a == b  # same seed, same text, even when run side by side
    assert a != c and all(a.values())


def test_async_whole_answer(aclient) -> None:
    async def main():
        return await aclient().chat.completions.create(model="smollm2", messages=CHAT, temperature=0, max_tokens=5)
    resp = asyncio.run(main())
    assert resp.usage.completion_tokens == 5 and resp.choices[0].finish_reason == "length"


def test_content_parts_tool_and_developer_messages(client: openai.OpenAI) -> None:
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    resp = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4, temperature=0)
    assert resp.usage.prompt_tokens > 10 and resp.choices[0].message.content is not None


def test_stop_strings_and_penalties(client: openai.OpenAI) -> None:
    base = dict(model="smollm2", temperature=0, max_tokens=24,
                messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}])
    full = client.chat.completions.create(**base).choices[0].message.content
    assert "3" in full
    cut = client.chat.completions.create(**base, stop=["3"])
    assert cut.choices[0].finish_reason == "stop" and "3" not in cut.choices[0].message.content
    assert full.startswith(cut.choices[0].message.content)
    biased = client.chat.completions.create(**base, presence_penalty=2.0, frequency_penalty=2.0,
                                            extra_body={"top_k": 1, "repetition_penalty": 1.5, "min_p": 0.1})
    assert biased.choices[0].message.content != full


def test_llama_server_samplers_by_their_names(client: openai.OpenAI) -> None:
    """mirostat, XTC, typical-p, top-n-sigma and the repeat window as llama-server takes them; seeded, so twice the
    same; a bad value is a 400 naming the field as sent."""
    prompt = "Once upon a time"
    for extra in ({"mirostat": 2, "mirostat_tau": 3.0}, {"mirostat": 1}, {"xtc_probability": 0.5, "xtc_threshold": 0.1},
                  {"typical_p": 0.7}, {"top_n_sigma": 1.0}, {"repeat_last_n": 8, "repetition_penalty": 1.3}):
        runs = [client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, seed=4, temperature=1.0,
                                          extra_body=extra).choices[0] for _ in range(2)]
        assert runs[0].text == runs[1].text and runs[0].text, extra
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smollm2", prompt=prompt, max_tokens=2, extra_body={"repeat_last_n": -5})
    assert err.value.body["param"] == "repeat_last_n"


def test_completions_batch_echo_and_logprobs(client: openai.OpenAI, smollm2_server) -> None:
    resp = client.completions.create(model="smollm2", prompt=["The sky is", "Water is"], n=2, max_tokens=4,
                                     temperature=0.8, seed=3, logprobs=2, echo=True)
    assert resp.object == "text_completion" and [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.choices[0].text.startswith("The sky is") and resp.choices[2].text.startswith("Water is")
    prompts = count_tokens(smollm2_server, prompt="The sky is") + count_tokens(smollm2_server, prompt="Water is")
    assert resp.usage.prompt_tokens == prompts and resp.usage.completion_tokens == 16
    lp = resp.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == count_tokens(smollm2_server, prompt="The sky is") + 4
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_completions_stream_of_token_id_prompt(client: openai.OpenAI) -> None:
    ids = [504, 7273, 314]  # "The sky is" in smollm2's vocabulary
    whole = client.completions.create(model="smollm2", prompt=ids, max_tokens=6, temperature=0)
    chunks = list(client.completions.create(model="smollm2", prompt=ids, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.prompt_tokens == 3 and chunks[-1].usage.completion_tokens == 6
    assert whole.choices[0].finish_reason == "length"


def test_ignore_eos_and_min_tokens(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="smollm2", prompt="Hi", max_tokens=9, temperature=0,
                                     extra_body={"ignore_eos": True, "min_tokens": 9})
    assert resp.usage.completion_tokens == 9 and resp.choices[0].finish_reason == "length"


def test_logit_bias_forces_a_token(client: openai.OpenAI, smollm2_server) -> None:
    r = httpx.post(f"{smollm2_server.url}/v1/tokenize", json={"prompt": " banana", "add_special_tokens": False},
                   headers={"Authorization": f"Bearer {API_KEY}"})
    token = r.json()["tokens"][0]
    resp = client.completions.create(model="smollm2", prompt="I like", max_tokens=3, logit_bias={str(token): 100},
                                     temperature=0)
    assert resp.choices[0].text.startswith(" banana")
