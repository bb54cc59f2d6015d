"""What Ollama users bring: options honoured (sampling, the load's context, batch and threads) or refused by
name, logprobs, fill-in-the-middle ``suffix`` — through the official ollama client against a real daemon whose
default context is set from the environment."""
from __future__ import annotations

import math
from collections.abc import Iterator

import ollama
import pytest

from runlm.runner.config import BackendConfig
from runlm.runner.errors import BadRequest
from runlm.runner.ollama_convert import sampling_fields
from runlm.runner.ollama_options import LoadOptions
from runlm.store import ModelStore
from tests.fixtures.models import fim_gguf
from tests.runner.daemon import Daemon, runlm

MODEL = "tinycoder"  # its own context is 2048
HI = [{"role": "user", "content": "hi"}]


def test_options_and_format_translate_to_openai_fields() -> None:
    out, load = sampling_fields({"options": {"num_predict": 7, "temperature": 0.2, "repeat_penalty": 1.1,
                                             "num_ctx": 4096, "stop": ["\n"], "top_k": 5, "seed": 3,
                                             "typical_p": 0.9, "repeat_last_n": 32, "mirostat": 2,
                                             "mirostat_tau": 4.0, "mirostat_eta": 0.2, "use_mmap": True},
                                 "format": "json"})
    assert out == {"max_tokens": 7, "temperature": 0.2, "repetition_penalty": 1.1, "stop": ["\n"], "top_k": 5,
                   "seed": 3, "typical_p": 0.9, "repeat_last_n": 32, "mirostat": 2, "mirostat_tau": 4.0,
                   "mirostat_eta": 0.2, "response_format": {"type": "json_object"}, "context_shift": True}
    assert load == LoadOptions(context=4096)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert sampling_fields({"format": schema})[0]["response_format"]["json_schema"]["schema"] == schema
    assert "max_tokens" not in sampling_fields({"options": {"num_predict": -1}})[0]


@pytest.mark.parametrize("option,value,words", [
    ("num_gpu", 99, "--device"), ("main_gpu", 1, "cuda:N"), ("use_mmap", False, "maps"),
    ("use_mlock", True, "lock"), ("numa", True, "NUMA"), ("num_ctx", 8, "at least 16"), ("num_thread", 0, "at least 1"),
    ("tfs_z", 0.9, "tail-free"), ("bogus", 1, "unknown option")])
def test_an_option_runlm_cannot_honour_is_refused_by_name(option: str, value: object, words: str) -> None:
    with pytest.raises(BadRequest) as err:
        sampling_fields({"options": {option: value}})
    assert err.value.param == f"options.{option}" and option in err.value.message and words in err.value.message


def test_load_options_replace_the_configured_flags_and_a_larger_context_serves() -> None:
    config = BackendConfig(context_size=512, runtime_flags=["--threads", "4", "--max-num-seqs", "8"])
    applied = LoadOptions(context=2048, batch=256, threads=2).apply(config)
    assert applied.context_size == 2048
    assert applied.runtime_flags == ["--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--threads", "2"]
    want = LoadOptions(context=1024)
    assert want.met_by(2048, 4096, config) and not want.met_by(512, 4096, config)
    assert LoadOptions(context=10**6).met_by(4096, 4096, config)  # no more than the model has
    assert not LoadOptions(threads=2).met_by(2048, 4096, config) and LoadOptions(threads=2).met_by(2048, 4096, applied)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    home = tmp_path_factory.mktemp("runlm-ctx")
    ModelStore(home).pull(MODEL)
    ModelStore(home).pull(str(fim_gguf("qwen")), "fimcoder")
    d = Daemon(home, env={"OLLAMA_CONTEXT_LENGTH": "256"}).start()
    yield d
    d.stop()


def _loaded(d: Daemon) -> dict:
    return next(m for m in d.http.get("/api/ps").json()["models"] if m["model"] == f"{MODEL}:latest")


def test_num_ctx_grows_the_context_by_reloading_and_never_shrinks_it(daemon: Daemon) -> None:
    c = ollama.Client(host=daemon.url)
    c.chat(model=MODEL, messages=HI, options={"num_predict": 1})
    assert _loaded(daemon)["context_length"] == 256  # the daemon's default, from $OLLAMA_CONTEXT_LENGTH
    pid = daemon.pid_of(f"{MODEL}:latest")
    c.chat(model=MODEL, messages=HI, options={"num_predict": 1, "num_ctx": 1024})
    assert _loaded(daemon)["context_length"] == 1024 and daemon.pid_of(f"{MODEL}:latest") != pid
    pid = daemon.pid_of(f"{MODEL}:latest")
    c.generate(model=MODEL, prompt="x", options={"num_predict": 1, "num_ctx": 512})  # smaller: served as loaded
    c.chat(model=MODEL, messages=HI, options={"num_predict": 1})
    assert _loaded(daemon)["context_length"] == 1024 and daemon.pid_of(f"{MODEL}:latest") == pid
    loaded = c.generate(model=MODEL, prompt="", options={"num_ctx": 100000})  # a preload: up to the model's own
    assert loaded.done_reason == "load" and _loaded(daemon)["context_length"] == 2048


def test_num_thread_reloads_with_that_many_threads(daemon: Daemon) -> None:
    c = ollama.Client(host=daemon.url)
    c.chat(model=MODEL, messages=HI, options={"num_predict": 1})
    pid = daemon.pid_of(f"{MODEL}:latest")
    r = c.chat(model=MODEL, messages=HI, options={"num_predict": 2, "num_thread": 1, "num_batch": 64})
    assert r.eval_count == 2 and daemon.pid_of(f"{MODEL}:latest") != pid
    pid = daemon.pid_of(f"{MODEL}:latest")
    c.chat(model=MODEL, messages=HI, options={"num_predict": 1, "num_thread": 1})
    assert daemon.pid_of(f"{MODEL}:latest") == pid


def test_llama_cpp_samplers_run_and_bad_values_name_the_option(daemon: Daemon) -> None:
    c = ollama.Client(host=daemon.url)
    for options in ({"mirostat": 2, "mirostat_tau": 3.0}, {"mirostat": 1}, {"typical_p": 0.5},
                    {"repeat_last_n": 4, "repeat_penalty": 1.3}):
        r = c.generate(model=MODEL, prompt="def f(x):", raw=True, options={"num_predict": 5, "seed": 1, **options})
        assert r.eval_count == 5, options
    with pytest.raises(ollama.ResponseError) as err:
        c.generate(model=MODEL, prompt="x", options={"mirostat": 3})
    assert err.value.status_code == 400 and "mirostat" in err.value.error


def test_logprobs_on_chat_and_generate_as_ollama_returns_them(daemon: Daemon) -> None:
    body = {"model": MODEL, "messages": HI, "stream": False, "logprobs": True, "top_logprobs": 3,
            "options": {"num_predict": 4, "temperature": 0}}
    r = daemon.http.post("/api/chat", json=body).json()
    assert len(r["logprobs"]) == 4
    first = r["logprobs"][0]
    assert first["logprob"] <= 0 and len(first["top_logprobs"]) == 3 and bytes(first["bytes"]).decode() == first["token"]
    assert first["top_logprobs"][0]["logprob"] == pytest.approx(first["logprob"])  # greedy: the top choice
    assert "".join(e["token"] for e in r["logprobs"]) == r["message"]["content"]
    lines = daemon.http.post("/api/generate", json={"model": MODEL, "prompt": "def add(a, b):", "raw": True,
                                                    "logprobs": True, "options": {"num_predict": 3}}).text
    import json
    chunks = [json.loads(line) for line in lines.splitlines()]
    got = [e for ch in chunks for e in ch.get("logprobs") or []]
    assert len(got) == 3 and all(e["top_logprobs"] == [] and math.isfinite(e["logprob"]) for e in got)
    bad = daemon.http.post("/api/chat", json={**body, "top_logprobs": 21})
    assert bad.status_code == 400 and "top_logprobs" in bad.json()["error"]


def test_a_bad_default_context_stops_the_daemon_start(tmp_path) -> None:
    out = runlm(tmp_path, "serve", "--port", "0", OLLAMA_CONTEXT_LENGTH="lots", timeout=60)
    assert out.returncode == 2 and "OLLAMA_CONTEXT_LENGTH" in out.stderr


def test_suffix_fills_the_middle_with_the_models_fim_tokens(daemon: Daemon) -> None:
    c = ollama.Client(host=daemon.url)
    options = {"num_predict": 6, "temperature": 0}
    got = c.generate(model="fimcoder", prompt="def add(a, b):\n    ", suffix="\n\nprint(add(1, 2))\n",
                     options=options)
    # the same as the FIM prompt written out by hand, raw
    raw = c.generate(model="fimcoder", raw=True, options=options,
                     prompt="<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n\nprint(add(1, 2))\n<|fim_middle|>")
    assert (got.response, got.eval_count, got.prompt_eval_count) == (raw.response, raw.eval_count,
                                                                      raw.prompt_eval_count)
    with pytest.raises(ollama.ResponseError) as err:
        c.generate(model=MODEL, prompt="def f(", suffix=")", options=options)
    assert err.value.status_code == 400 and "fill-in-the-middle" in err.value.error


def test_create_quantize_stores_a_quantized_copy(daemon: Daemon) -> None:
    c = ollama.Client(host=daemon.url)
    events = list(c.create(model="tiny-q8", from_=MODEL, quantize="q8_0", stream=True))
    assert events[-1].status == "success" and any("quantizing" in (e.status or "") for e in events)
    assert c.show("tiny-q8").details.quantization_level == "Q8_0"
    r = c.generate(model="tiny-q8", prompt="def f(", raw=True, options={"num_predict": 3}, keep_alive=0)
    assert r.eval_count == 3 and daemon.wait_unloaded("tiny-q8:latest")
    with pytest.raises(ollama.ResponseError) as err:
        c.create(model="tiny-q9", from_=MODEL, quantize="q9_9")
    assert err.value.status_code == 400 and "q9_9" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        c.create(model="tiny-q4", from_="tiny-q8", quantize="q4_0")  # already quantized
    assert err.value.status_code == 400 and "already Q8_0" in err.value.error
    c.delete("tiny-q8")


def test_runlm_run_on_the_daemon_takes_the_chat_commands(daemon: Daemon) -> None:
    from tests.test_chat_commands import _Pty
    from tests.test_cli import ENV

    chat = _Pty(MODEL, "--max-tokens", "3", "--temperature", "0", "--verbose",
                env={**ENV, "RUNLM_HOST": daemon.url.removeprefix("http://")})
    try:
        assert "Set parameter 'repeat_last_n' to '8'" in chat.send("/set parameter repeat_last_n 8")
        assert "Set parameter 'num_ctx' to '1536'" in chat.send("/set parameter num_ctx 1536")
        assert "2048" in chat.send("/show info")  # the daemon's /api/show: tinycoder's own context length
        answer = chat.send("hello")
        assert "eval count:           3 token(s)" in answer and "prompt eval count:" in answer
        assert "Cleared session context" in chat.send("/clear")
    finally:
        assert chat.close() == 0


def test_a_long_answer_shifts_the_context_and_a_long_chat_is_truncated(daemon: Daemon) -> None:
    c = ollama.Client(host=daemon.url)
    chat = [{"role": "user", "content": "Tell me a long story."}]
    c.chat(model=MODEL, messages=chat, options={"num_predict": 1})
    ctx = _loaded(daemon)["context_length"]  # (whatever earlier tests left it at)
    long = c.chat(model=MODEL, messages=chat, options={"num_predict": ctx, "num_keep": 8, "temperature": 0})
    assert long.eval_count == ctx and long.prompt_eval_count + ctx > ctx  # past the context
    # without shift (Ollama's request field; this ollama client does not send it): the limit and the length, named
    r = daemon.http.post("/api/chat", json={"model": MODEL, "messages": chat, "options": {"num_predict": ctx},
                                            "shift": False, "stream": False})
    assert r.status_code == 400 and str(ctx) in r.json()["error"], r.text
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "words " * 20}
             for i in range(ctx // 20 + 1)]
    kept = c.chat(model=MODEL, messages=turns, options={"num_predict": 2})  # Ollama's default: truncate
    assert kept.prompt_eval_count is not None and kept.prompt_eval_count <= ctx - 2
    r = daemon.http.post("/api/chat", json={"model": MODEL, "messages": turns, "options": {"num_predict": 2},
                                            "truncate": False, "stream": False})
    assert r.status_code == 400 and "context" in r.json()["error"], r.text


def test_a_requests_go_template_makes_the_prompt_and_an_old_context_is_refused(daemon: Daemon) -> None:
    c = ollama.Client(host=daemon.url)
    options = {"num_predict": 1, "temperature": 0}
    # Ollama's older template shape: the prompt ends where .Response begins
    templated = c.generate(model=MODEL, prompt="hi", system="Be brief.", options=options,
                           template="{{ if .System }}[{{ .System }}] {{ end }}Q: {{ .Prompt }}\nA: {{ .Response }}!")
    raw = c.generate(model=MODEL, prompt="[Be brief.] Q: hi\nA: ", raw=True, options=options)
    assert templated.prompt_eval_count == raw.prompt_eval_count and templated.response == raw.response
    messages = c.generate(model=MODEL, prompt="hi", options=options,
                          template="{{ range .Messages }}<{{ .Role }}>{{ .Content }}{{ end }}<assistant>")
    assert messages.prompt_eval_count == c.generate(model=MODEL, prompt="<user>hi<assistant>", raw=True,
                                                    options=options).prompt_eval_count
    for bad in ("{{ if .Prompt }}", "{{ nosuchfunc .Prompt }}", "{{ index .Messages 9 }}"):
        with pytest.raises(ollama.ResponseError) as err:
            c.generate(model=MODEL, prompt="hi", template=bad)
        assert err.value.status_code == 400 and "template" in err.value.error, bad
    with pytest.raises(ollama.ResponseError) as err:
        c.generate(model=MODEL, prompt="hi", context=[1, 2, 3])
    assert err.value.status_code == 400 and "context" in err.value.error
