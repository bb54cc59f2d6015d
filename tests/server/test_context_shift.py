"""Long conversations on a small context (96 tokens): a generation that fills it goes on when it shifts (the
first n_keep tokens kept, half of the rest dropped, the rest recomputed), and equals — token for token, greedy —
the two requests one would make by hand; a chat longer than the context loses its oldest messages with
``truncate``; without either, the 400 names the limit and the length. Through the official openai client."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from runlm.server.context_shift import shifted
from tests.server.process import ServerProcess

CONTEXT = 96


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess("tinycoder", ["--max-model-len", str(CONTEXT), "--served-model-name", "tiny"]).start()
    yield s
    s.stop()


def _ids(server: ServerProcess, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": text}).json()["tokens"]


def _greedy(server: ServerProcess, prompt: list[int], n: int, **extra: object) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_shifted_generation_equals_the_requests_made_by_hand(server: ServerProcess) -> None:
    prompt = _ids(server, "def fibonacci(n):\n    " * 4)
    room = CONTEXT - len(prompt)
    out = _greedy(server, prompt, room + 20, context_shift=True, n_keep=4)
    assert out["usage"]["completion_tokens"] == room + 20 and out["usage"]["prompt_tokens"] == len(prompt)
    assert out["choices"][0]["finish_reason"] == "length"
    first = _greedy(server, prompt, room)  # what fits, then the shifted sequence continued
    answer = _ids_of(first, server)
    assert len(answer) == room  # (the text reads back as the tokens that made it)
    rest = _greedy(server, shifted(prompt + answer, 4, _bos(server)), 20)
    assert out["choices"][0]["text"] == first["choices"][0]["text"] + rest["choices"][0]["text"]


def _bos(server: ServerProcess) -> int | None:
    empty = _ids(server, "")
    return empty[0] if empty else None


def _ids_of(out: dict, server: ServerProcess) -> list[int]:
    """An answer's token ids, from its text (tinycoder's tokenizer reads its own output back the same)."""
    ids = _ids(server, out["choices"][0]["text"])
    bos = _bos(server)
    return ids[1:] if bos is not None and ids[:1] == [bos] else ids


def test_streamed_shift_and_the_refusal_without_it(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="-")
    prompt = "Write a long story about a robot. " * 3
    n = CONTEXT
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"context_shift": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == n
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=n)
    assert "maximum context length is 96" in str(err.value)


def test_truncate_drops_the_oldest_messages_and_keeps_the_system_prompt(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="-")
    system = {"role": "system", "content": "Be brief."}
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message number {i} about nothing"}
             for i in range(15)]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[system, *turns], max_tokens=8)  # type: ignore[list-item]
    done = client.chat.completions.create(model="tiny", messages=[system, *turns], max_tokens=8,  # type: ignore[list-item]
                                          extra_body={"truncate": True})
    assert done.usage is not None and done.usage.prompt_tokens + 8 <= CONTEXT
    # the prompt is the system message and the longest run of latest messages that fits
    counts = [httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "messages": [system, *turns[-k:]]}).json()
              ["count"] for k in range(1, len(turns) + 1)]
    assert done.usage.prompt_tokens == max(c for c in counts if c + 8 <= CONTEXT)


def test_a_shift_keeps_the_bos_and_n_keep_and_drops_half_of_the_rest() -> None:
    tokens = [1, *range(100, 110)]  # a BOS, then ten tokens
    assert shifted(tokens, 2, bos=1) == [1, 100, 101, 106, 107, 108, 109]  # 8 after the kept: 4 dropped
    assert shifted(tokens[1:], 0, bos=1) == [105, 106, 107, 108, 109]
    assert len(shifted(tokens, 100, bos=1)) == len(tokens) - 1  # n_keep past the end still frees a token
