"""Models made from Modelfiles: ``runlm create -f`` and ``show --modelfile`` on the store, then the same model served
by a daemon — its TEMPLATE (Ollama's Go), SYSTEM, MESSAGE history, stop strings and num_ctx in effect on the Ollama
and OpenAI routes — and Ollama's ``/api/create`` fields through the official ``ollama`` client."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import ollama
import openai
import pytest

from runlm.engine.llm import encode_chat
from runlm.formats.gguf import GGUFFile
from runlm.formats.modelfile import ChatDefaults, parse_modelfile
from runlm.formats.tokenizer import Tokenizer
from runlm.store import ModelStore
from tests.runner.daemon import Daemon, runlm

BASE = "tinycoder"
TEMPLATE = ("{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}{{ if .Prompt }}<|im_start|>user\n"
            "{{ .Prompt }}<|im_end|>\n{{ end }}<|im_start|>assistant\n{{ .Response }}<|im_end|>\n")
MODELFILE = f'''FROM {BASE}
TEMPLATE """{TEMPLATE}"""
SYSTEM You answer in one word.
MESSAGE user Colour of the sky?
MESSAGE assistant Blue.
PARAMETER temperature 0
PARAMETER num_ctx 512
PARAMETER stop "<|im_end|>"
'''
HI = [{"role": "user", "content": "Colour of grass?"}]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("runlm-modelfile")
    ModelStore(home).pull(BASE)
    folder = tmp_path_factory.mktemp("mf")
    (folder / "Modelfile").write_text(MODELFILE)
    made = runlm(home, "create", "oneword", "-f", str(folder / "Modelfile"))
    assert made.returncode == 0, made.stderr
    return home


def _prompt_tokens(home: Path, messages: list[dict]) -> int:
    """What the model's prompt should be: the Modelfile's messages around ``messages``, through its Go template."""
    store = ModelStore(home)
    tok = Tokenizer.from_gguf(GGUFFile(store.model_path(store.get(BASE))))
    defaults = ChatDefaults("You answer in one word.", ({"role": "user", "content": "Colour of the sky?"},
                                                         {"role": "assistant", "content": "Blue."}))
    return len(encode_chat(tok, defaults.chat(messages), TEMPLATE))


def test_create_and_show_modelfile_on_the_store(home: Path, tmp_path: Path) -> None:
    shown = runlm(home, "show", "oneword", "--modelfile")
    assert shown.returncode == 0, shown.stderr
    mf = parse_modelfile(shown.stdout)
    assert mf.base == f"{BASE}:latest" and mf.template == TEMPLATE and mf.system == "You answer in one word."
    assert mf.parameters["stop"] == ["<|im_end|>"] and mf.parameters["num_ctx"] == 512
    assert mf.parameters["temperature"] == 0
    assert [m["content"] for m in mf.messages] == ["Colour of the sky?", "Blue."]
    # what show printed makes the same model again
    (tmp_path / "Modelfile").write_text(shown.stdout)
    again = runlm(home, "create", "again", "-f", str(tmp_path / "Modelfile"))
    assert again.returncode == 0, again.stderr
    assert ModelStore(home).get("again").info.template == TEMPLATE
    (tmp_path / "Modelfile").write_text(f"FROM {BASE}\nPARAMETER temperature 0.3\nTEMPLTE x\n")
    bad = runlm(home, "create", "bad", "-f", str(tmp_path / "Modelfile"))
    assert bad.returncode != 0 and "line 3" in bad.stderr and "TEMPLTE" in bad.stderr
    (tmp_path / "Modelfile").write_text(f"FROM {BASE}\nPARAMETER num_gpu 99\n")
    bad = runlm(home, "create", "bad", "-f", str(tmp_path / "Modelfile"))
    assert bad.returncode != 0 and "num_gpu" in bad.stderr


@pytest.fixture(scope="module")
def daemon(home: Path) -> Iterator[Daemon]:
    d = Daemon(home).start()
    yield d
    d.stop()


def test_a_modelfile_models_defaults_follow_it_on_every_route(home: Path, daemon: Daemon) -> None:
    c = ollama.Client(host=daemon.url)
    want = _prompt_tokens(home, HI)
    out = c.chat(model="oneword", messages=HI, options={"num_predict": 4})
    assert out.prompt_eval_count == want
    ps = next(m for m in daemon.http.get("/api/ps").json()["models"] if m["model"] == "oneword:latest")
    assert ps["context_length"] == 512  # the Modelfile's num_ctx
    oa = openai.OpenAI(base_url=daemon.url + "/v1", api_key="-")
    done = oa.chat.completions.create(model="oneword", messages=HI, max_tokens=4)  # type: ignore[arg-type]
    assert done.usage is not None and done.usage.prompt_tokens == want
    own = [{"role": "system", "content": "Be verbose."}, *HI]  # a request's own system prompt replaces SYSTEM
    assert c.chat(model="oneword", messages=own, options={"num_predict": 1}).prompt_eval_count != want
    shown = c.show("oneword")
    assert shown.template == TEMPLATE and 'stop                           "<|im_end|>"' in (shown.parameters or "")
    assert "SYSTEM You answer in one word." in (shown.modelfile or "")


def test_ollama_api_create_fields(home: Path, daemon: Daemon) -> None:
    c = ollama.Client(host=daemon.url)
    made = c.create(model="terse", from_=BASE, system="Be terse.", parameters={"temperature": 0.1, "stop": ["\n\n"]},
                    messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                    license="MIT", stream=False)
    assert made.status == "success"
    shown = daemon.http.post("/api/show", json={"model": "terse"}).json()
    assert shown["system"] == "Be terse." and shown["license"] == "MIT" and len(shown["messages"]) == 2
    assert "temperature                    0.1" in shown["parameters"]
    assert c.generate(model="terse", prompt="Say hi", options={"num_predict": 2}).done
    # a model made of uploaded files, as `ollama create` from a GGUF path sends it
    store = ModelStore(home)
    digest = c.create_blob(store.model_path(store.get(BASE)))
    assert c.create(model="uploaded", files={"tiny.gguf": digest}, system="S.", stream=False).status == "success"
    assert ModelStore(home).get("uploaded").info.architecture == store.get(BASE).info.architecture
    for body, param in (({"parameters": {"bogus": 1}}, "parameters.bogus"),
                        ({"parameters": {"temperature": 9}}, "parameters.temperature"),
                        ({"template": "{{ range .Messages }}"}, "template"),
                        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
                        ({"files": {"../x.gguf": digest}, "from": None}, "files")):
        r = daemon.http.post("/api/create", json={"model": "bad", "from": BASE, **body})
        assert r.status_code == 400, (body, r.text)
        assert param.split(".")[-1].split("[")[0] in r.text, (body, r.text)


def test_a_configured_chat_template_replaces_the_models(home: Path, daemon: Daemon, tmp_path: Path) -> None:
    """``runlm configure MODEL --chat-template-file FILE``: the CLI reads the file, the daemon takes its text (never
    a path) and the native backend renders every chat with it."""
    template = "{{ range .Messages }}[{{ .Role }}] {{ .Content }}\n{{ end }}[assistant] "
    (tmp_path / "t.gotmpl").write_text(template)
    done = runlm(home, "configure", BASE, "--chat-template-file", str(tmp_path / "t.gotmpl"))
    assert done.returncode == 0, done.stderr
    c = ollama.Client(host=daemon.url)
    store = ModelStore(home)
    tok = Tokenizer.from_gguf(GGUFFile(store.model_path(store.get(BASE))))
    out = c.chat(model=BASE, messages=HI, options={"num_predict": 1})
    assert out.prompt_eval_count == len(encode_chat(tok, HI, template))
    for bad in ({"chat-template": "{{ range .Messages }}"}, {"chat-template": "/etc/passwd"},
                {"chat_template": 42}):
        r = daemon.http.post("/engines/_configure", json={"model": BASE, **bad})
        if bad.get("chat-template") == "/etc/passwd":  # a path is only text: the template renders it, reads nothing
            assert r.status_code in (200, 202), r.text
            continue
        assert r.status_code == 400 and "chat_template" in r.text, r.text
    bad_file = runlm(home, "configure", BASE, "--chat-template-file", str(tmp_path / "missing"))
    assert bad_file.returncode == 2 and "--chat-template-file" in bad_file.stderr
