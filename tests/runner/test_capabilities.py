"""What a model accepts, as the daemon reports it: Ollama's /api/show ``capabilities`` (and ``projector_info``),
``capabilities`` on /v1/models entries and Model Runner's /models/{name}, ``runlm show``; and the engine
launchers given the store's projector file (``--mmproj``) for a GGUF that has one."""
from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from runlm.models.vision import FAMILIES
from runlm.runner.app import create_app
from runlm.runner.backends.llamacpp import LlamaCppBackend
from runlm.runner.backends.native import NativeBackend, projector_bytes
from runlm.runner.config import BackendConfig, BackendMode
from runlm.store import ModelStore
from runlm.store.capabilities import capabilities
from tests.runner.daemon import runlm
from tests.store.test_mmproj_store import write_projector

THINKING_TOOLS = ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
                  "{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n<think>\n")


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, tinycoder_gguf: Path) -> Path:
    root = tmp_path_factory.mktemp("caps")
    folder = root / "files"
    folder.mkdir()
    shutil.copy(tinycoder_gguf, folder / "tiny-vlm.gguf")
    write_projector(folder / "mmproj-tiny-vlm-f16.gguf")
    store = ModelStore(root / "home")
    store.pull(str(folder / "tiny-vlm.gguf"), "vlm")
    text = store.pull(str(tinycoder_gguf), "text")
    manifest = json.loads(json.dumps(text.manifest))
    manifest["info"]["template"] = THINKING_TOOLS
    with store.adding():
        store.write_ref("reasoner", manifest)
    return root / "home"


@pytest.fixture(scope="module")
def client(home: Path):
    with TestClient(create_app(ModelStore(home)), base_url="http://127.0.0.1") as c:
        yield c


def test_ollama_show_capabilities(client: TestClient) -> None:
    vlm = client.post("/api/show", json={"model": "vlm"}).json()
    assert vlm["capabilities"] == ["completion", "vision"]
    assert vlm["details"]["families"] == ["llama", "clip"]
    assert vlm["projector_info"]["general.architecture"] == "clip"
    assert vlm["projector_info"]["clip.projector_type"] == "idefics3"
    text = client.post("/api/show", json={"model": "text"}).json()
    assert text["capabilities"] == ["completion"] and "projector_info" not in text
    assert client.post("/api/show", json={"model": "reasoner"}).json()["capabilities"] == \
        ["completion", "tools", "thinking"]


def test_openai_and_model_runner_listings(client: TestClient) -> None:
    data = {d["id"]: d for d in client.get("/v1/models").json()["data"]}
    assert data["vlm:latest"]["capabilities"] == ["completion", "vision"]
    assert data["vlm:latest"]["input_modalities"] == ["text", "image"]
    assert data["text:latest"]["capabilities"] == ["completion"]
    assert data["text:latest"]["input_modalities"] == ["text"]
    assert client.get("/v1/models/vlm").json()["capabilities"] == ["completion", "vision"]
    config = client.get("/models/vlm").json()["config"]
    assert config["capabilities"] == ["completion", "vision"] and config["input_modalities"] == ["text", "image"]


def test_runlm_show_says_what_it_accepts(home: Path) -> None:
    out = runlm(home, "show", "vlm", timeout=60)
    assert out.returncode == 0, out.stderr
    lines = {line.split(None, 1)[0]: line.split(None, 1)[1].strip() for line in out.stdout.splitlines()
             if line.startswith("    ") and len(line.split(None, 1)) == 2}
    assert lines["capabilities"] == "completion, vision" and lines["input"] == "text, image"
    shown = json.loads(runlm(home, "show", "text", "--json", timeout=60).stdout)
    assert shown["config"]["input_modalities"] == ["text"]


def test_launchers_get_the_stores_projector(home: Path) -> None:
    store = ModelStore(home)
    vlm, text = store.get("vlm"), store.get("text")
    path = store.model_path(vlm)
    native = NativeBackend(store.logs)
    argv = native.command("/tmp/s.sock", str(path), "vlm:latest", vlm, BackendConfig())
    i = argv.index("--mmproj")
    assert Path(argv[i + 1]) == path.parent / "mmproj-tiny-vlm-f16.gguf" and Path(argv[i + 1]).is_file()
    assert native.command("/tmp/s.sock", str(store.model_path(text)), "text:latest", text,
                                   BackendConfig()).count("--mmproj") == 0
    assert projector_bytes(vlm) > 0 and projector_bytes(text) == 0
    backend = LlamaCppBackend(store.logs)
    backend._binary = lambda: "/usr/bin/llama-server"  # type: ignore[method-assign]
    argv = backend.command("127.0.0.1:9", str(path), "vlm:latest", BackendMode.COMPLETION, BackendConfig(), vlm)
    assert argv[argv.index("--mmproj") + 1] == str(path.parent / "mmproj-tiny-vlm-f16.gguf")


def test_runtime_flags_cannot_name_a_projector(home: Path) -> None:
    from runlm.runner.config import ConfigError

    with pytest.raises(ConfigError, match="not allowed"):
        NativeBackend(home / "logs").check_flags(["--mmproj", "/etc/passwd"])


def test_vision_language_safetensors_dir(monkeypatch: pytest.MonkeyPatch, tiny_model, tmp_path: Path) -> None:
    """A config whose model_type a vision family serves: vision, and the decoder's shapes from text_config."""
    from runlm.models import vision
    from runlm.store.metadata import inspect_safetensors_dir

    folder = tmp_path / "vlm"
    shutil.copytree(tiny_model("llama"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    text_cfg = {k: cfg.pop(k) for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                         "hidden_size", "max_position_embeddings")}
    cfg.update(model_type="toyvlm", architectures=["ToyVLMForConditionalGeneration"], text_config=text_cfg,
               vision_config={"hidden_size": 8})
    (folder / "config.json").write_text(json.dumps(cfg))
    family = types.SimpleNamespace(MODEL_TYPES=("toyvlm",), text_config=lambda c: dict(c["text_config"]))
    monkeypatch.setattr(vision, "hf_family", lambda c: family if c.get("model_type") == "toyvlm" else None)
    monkeypatch.setattr(vision, "is_vision_config", lambda c: c.get("model_type") == "toyvlm")
    info = inspect_safetensors_dir(folder)
    assert info.capabilities == ["completion", "vision"]
    assert info.num_layers == text_cfg["num_hidden_layers"] and info.num_kv_heads == text_cfg["num_key_value_heads"]
    store = ModelStore(tmp_path / "home")
    model = store.pull(str(folder), "toy")
    assert capabilities(model) == ["completion", "vision"] and model.mmproj is None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_safetensors_dirs_are_vision_models(family: str, tmp_path: Path) -> None:
    """Each family's tiny transformers checkpoint, as Hugging Face lays them out."""
    from tests.fixtures.vlm import vlm_dir

    pytest.importorskip(f"tests.fixtures.vlm.{family}")
    folder = vlm_dir(family)
    text_layers = json.loads((folder / "config.json").read_text())["text_config"]["num_hidden_layers"]
    model = ModelStore(tmp_path / "home").pull(str(folder), family)
    assert capabilities(model) == ["completion", "vision"] and model.info.num_layers == text_layers


def test_cli_pull_and_package_take_mmproj(tmp_path: Path, tinycoder_gguf: Path) -> None:
    home = tmp_path / "home"
    proj = write_projector(tmp_path / "proj.gguf")
    out = runlm(home, "pull", str(tinycoder_gguf), "--name", "pulled", "--mmproj", str(proj), timeout=60)
    assert out.returncode == 0, out.stderr
    out = runlm(home, "package", str(tinycoder_gguf), "team/vlm:v1", "--mmproj", str(proj), timeout=60)
    assert out.returncode == 0, out.stderr
    store = ModelStore(home)
    assert store.get("pulled").mmproj == "mmproj-proj.gguf" and store.get("team/vlm:v1").mmproj == "mmproj-proj.gguf"
    layers = json.loads(store.blobs.path(store.get("team/vlm:v1").manifest["oci"]["manifest"]).read_bytes())["layers"]
    assert layers[-1]["mediaType"] == "application/vnd.docker.ai.mmproj"
    bad = runlm(home, "pull", str(tinycoder_gguf), "--mmproj", str(tinycoder_gguf), timeout=60)
    assert bad.returncode == 1 and "not a multimodal projector" in bad.stderr
