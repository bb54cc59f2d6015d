"""The Responses and Anthropic Messages APIs through the daemon (official clients): translated to the backend's chat
completions, on every OpenAI prefix, with the daemon's own store of responses."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.runner.daemon import Daemon


def client(daemon: Daemon, prefix: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + prefix, api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("prefix", ["/v1", "/engines/native/v1"])
def test_responses_whole_and_streamed(daemon: Daemon, prefix: str) -> None:
    c = client(daemon, prefix)
    body = dict(model="tinycoder", input="def add(a, b):", max_output_tokens=5, temperature=0)
    whole = c.responses.create(**body)
    assert whole.output_text and whole.usage.output_tokens == 5 and whole.status == "incomplete"
    assert whole.model == "tinycoder:latest"
    events = list(c.responses.create(stream=True, **body))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert c.responses.retrieve(whole.id).output_text == whole.output_text


def test_chained_responses_and_errors(daemon: Daemon) -> None:
    c = client(daemon)
    first = c.responses.create(model="tinycoder", input="x = 1", max_output_tokens=3, temperature=0)
    second = c.responses.create(model="tinycoder", input="y = 2", previous_response_id=first.id, max_output_tokens=3,
                                temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="pull it first"):
        c.responses.create(model="no-such-model", input="x")
    with pytest.raises(openai.BadRequestError) as err:  # the backend's validation, named as the client sent it
        c.responses.create(model="tinycoder", input="x", max_output_tokens=-1)
    assert err.value.body["param"] == "max_output_tokens"
    r = daemon.http.post("/engines/nosuch/v1/responses", json={"model": "tinycoder", "input": "x"})
    assert r.status_code == 404 and "nosuch" in r.json()["error"]["message"]


def test_anthropic_messages_through_the_daemon(daemon: Daemon) -> None:
    import anthropic
    c = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=300)
    ask = dict(model="tinycoder", max_tokens=4, messages=[{"role": "user", "content": "def add(a, b):"}],
               extra_body={"temperature": 0})
    whole = c.messages.create(**ask)
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 4 and whole.model == "tinycoder:latest"
    with c.messages.stream(**ask) as stream:
        assert stream.get_final_message().content[0].text == whole.content[0].text
    count = c.messages.count_tokens(model="tinycoder", messages=ask["messages"])
    assert count.input_tokens == whole.usage.input_tokens
    with pytest.raises(anthropic.NotFoundError) as err:
        c.messages.create(model="no-such-model", max_tokens=2, messages=ask["messages"])
    assert err.value.body["error"]["type"] == "not_found_error" and "pull it first" in err.value.body["error"]["message"]


def test_delete_model_is_409_while_in_use_then_deletes(daemon: Daemon) -> None:
    r = daemon.http.post("/models/tinycoder/tag", json={"target": "tc-delete:latest"})
    assert r.status_code in (200, 201), r.text
    c = client(daemon)
    daemon.http.post("/engines/unload", json={"all": True})
    answers: list[int] = []
    # a request that is loading the model holds it: the deletion waits for its answer (a 409 until then)
    ask = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{daemon.url}/v1/completions", json={"model": "tc-delete", "prompt": "a", "max_tokens": 2},
        timeout=300).status_code))
    ask.start()
    deadline = time.monotonic() + 60
    while not [r for r in daemon.ps() if r["model_name"] == "tc-delete:latest"] and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(openai.ConflictError, match="in use"):
        c.models.delete("tc-delete")
    ask.join()
    assert answers == [200]
    gone = daemon.http.delete("/v1/models/tc-delete")
    assert gone.status_code == 200 and gone.json() == {"id": "tc-delete:latest", "object": "model", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("tc-delete")
    with pytest.raises(openai.NotFoundError):
        c.models.delete("tc-delete")
    assert "tinycoder:latest" in {m.id for m in c.models.list()}  # only that name went; the blobs it shares stay
    assert all(r["model_name"] != "tc-delete:latest" for r in daemon.ps())  # and what was loaded under it
    daemon.http.post("/v1/completions", json={"model": "tinycoder", "prompt": "a", "max_tokens": 1})
    assert "tinycoder:latest" in {r["model_name"] for r in daemon.ps()}  # loaded again under the name asked for


def test_chat_page_and_its_calls_pass_the_browser_guard(daemon: Daemon) -> None:
    from tests.server.test_chat_page import check_page
    check_page(daemon.url)
    # the page's own origin may post; another site's may not
    ask = {"model": "tinycoder", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert daemon.http.post("/v1/chat/completions", json=ask, headers={"Origin": daemon.url}).status_code == 200
    r = daemon.http.post("/v1/chat/completions", json=ask, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403
