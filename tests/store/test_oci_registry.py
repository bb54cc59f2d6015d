"""push and pull against a real registry (CNCF Distribution on a loopback port, basic auth)."""
from __future__ import annotations

import hashlib
import json
import socket
import threading
from pathlib import Path

import pytest

from runlm.store import ModelStore
from runlm.store.blobs import BlobDigestError
from runlm.store.download import DownloadLimits
from runlm.store.oci import credentials, media
from runlm.store.oci.client import RegistryAuthError, RegistryClient, RegistryError
from runlm.store.oci.reference import parse_reference
from runlm.store.oci.transfer import package, pull, push
from runlm.store.progress import PullProgress
from tests.fixtures.registry import PASSWORD, USER, Registry


def _login(store: ModelStore, registry: Registry, password: str = PASSWORD) -> None:
    credentials.save(registry.host, credentials.Credentials(USER, password), store.home)


def _files(store: ModelStore, name: str) -> dict[str, bytes]:
    model = store.get(name)
    return {f["path"]: store.blobs.path(f["digest"]).read_bytes() for f in model.manifest["files"]}


@pytest.fixture
def packaged(store: ModelStore, registry: Registry, tinycoder_gguf: Path, tmp_path: Path) -> ModelStore:
    lic = tmp_path / "LICENSE"
    lic.write_text("test license\n")
    package(store, tinycoder_gguf, "tiny", (lic,), context_size=1024)
    _login(store, registry)
    return store


def test_round_trip_is_byte_identical(packaged: ModelStore, registry: Registry, tmp_path: Path) -> None:
    store = packaged
    before = store.get("tiny")
    files = _files(store, "tiny")
    ref, digest = push(store, "tiny", f"{registry.host}/team/tiny:v1", insecure=True, chunk_size=1 << 20)
    assert digest == before.manifest["oci"]["manifest"]
    log = registry.access_log()
    assert any('"PATCH /v2/team/tiny/blobs/uploads/' in line and '" 202 ' in line for line in log)  # chunked
    assert any('"PUT /v2/team/tiny/blobs/uploads/' in line and '" 201 ' in line for line in log)
    # the registry holds our manifest bytes, under the same digest, by tag and by digest
    with RegistryClient(registry.host, credentials.Credentials(USER, PASSWORD), insecure=True) as client:
        by_tag = client.get_manifest(ref)
        assert by_tag.digest == digest and by_tag.media_type == media.OCI_MANIFEST
        assert client.get_manifest(parse_reference(f"{registry.host}/team/tiny@{digest}")).body == by_tag.body
    # a second store (another machine) pulls it: same files, same digests
    other = ModelStore(tmp_path / "other")
    _login(other, registry)
    events: list[PullProgress] = []
    model = other.pull(f"{registry.host}/team/tiny:v1", insecure=True, progress=events.append)
    assert str(model.name) == "team/tiny:v1"
    assert _files(other, "team/tiny:v1") == files
    assert model.manifest["oci"]["manifest"] == digest and model.manifest["oci"]["context_size"] == 1024
    assert model.manifest["oci"]["reference"] == f"{registry.host}/team/tiny:v1"
    assert model.info.architecture == "llama" and other.model_path(model).name == "model.gguf"
    assert events[0].status == "pulling manifest" and events[-1].status == "success"
    # pulling again transfers nothing
    log_len = len(registry.access_log())
    other.pull(f"{registry.host}/team/tiny:v1", insecure=True)
    assert not any("/blobs/sha256" in line and '"GET' in line for line in registry.access_log()[log_len:])


def test_push_to_another_repository_mounts_blobs(packaged: ModelStore, registry: Registry) -> None:
    store = packaged
    push(store, "tiny", f"{registry.host}/team/a:v1", insecure=True)
    log_len = len(registry.access_log())
    push(store, "tiny", f"{registry.host}/team/b:v1", insecure=True)  # the model now knows team/a has the blobs
    new = registry.access_log()[log_len:]
    mounted = [line for line in new if "?mount=sha256:" in line and "from=team/a" in line and '" 201 ' in line]
    assert len(mounted) == 3  # the config, the GGUF file and the license
    assert not any('"PUT /v2/team/b/blobs/uploads/' in line for line in new)  # nothing uploaded again


def test_interrupted_pull_resumes(packaged: ModelStore, registry: Registry, tmp_path: Path) -> None:
    push(packaged, "tiny", f"{registry.host}/team/resume:v1", insecure=True)
    gguf = packaged.get("tiny").manifest["files"][0]
    other = ModelStore(tmp_path / "other")
    _login(other, registry)

    class Stop(Exception):
        pass

    def stop_midway(p: PullProgress) -> None:
        if p.digest == gguf["digest"] and 0 < p.completed < p.total:
            raise Stop

    with pytest.raises(Stop):
        other.pull(f"{registry.host}/team/resume:v1", insecure=True, progress=stop_midway)
    partial = other.partial / f"{gguf['digest'].replace(':', '-')}.partial"
    kept = partial.stat().st_size
    assert 0 < kept < gguf["size"]
    events: list[PullProgress] = []
    model = other.pull(f"{registry.host}/team/resume:v1", insecure=True, progress=events.append)
    firsts = [e.completed for e in events if e.digest == gguf["digest"]]
    assert min(firsts) > kept  # it went on from the partial file instead of starting over
    assert _files(other, str(model.name)) == _files(packaged, "tiny") and not partial.exists()


def test_tampered_blob_is_refused(packaged: ModelStore, registry: Registry, tmp_path: Path) -> None:
    push(packaged, "tiny", f"{registry.host}/team/tampered:v1", insecure=True)
    gguf = packaged.get("tiny").manifest["files"][0]
    blob = registry.blob_file(gguf["digest"])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    other = ModelStore(tmp_path / "other")
    _login(other, registry)
    try:
        with pytest.raises(BlobDigestError, match="do not match"):
            other.pull(f"{registry.host}/team/tampered:v1", insecure=True)
        assert other.list() == [] and not other.blobs.has(gguf["digest"])
        assert not list(other.partial.glob("*.partial"))
    finally:
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))


def test_credentials_errors_are_clear(packaged: ModelStore, registry: Registry, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker"))
    anonymous = ModelStore(tmp_path / "anon")
    with pytest.raises(RegistryAuthError, match=f"needs credentials: run `runlm login {registry.host}`"):
        anonymous.pull(f"{registry.host}/team/tiny:v1", insecure=True)
    _login(packaged, registry, "wrong")
    with pytest.raises(RegistryAuthError, match=f"refused the credentials for user '{USER}'"):
        push(packaged, "tiny", f"{registry.host}/team/x:v1", insecure=True)


def test_docker_config_credentials_work(store: ModelStore, registry: Registry, tinycoder_gguf: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import base64
    (tmp_path / "docker").mkdir()
    auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    (tmp_path / "docker/config.json").write_text(json.dumps({"auths": {registry.host: {"auth": auth}}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    package(store, tinycoder_gguf, "tiny")
    assert push(store, "tiny", f"{registry.host}/team/docker-creds:v1", insecure=True)[1]


def test_unknown_model_and_plain_http_without_insecure(packaged: ModelStore, registry: Registry) -> None:
    with pytest.raises(RegistryError, match="no such model"):
        packaged.pull(f"{registry.host}/team/never-pushed:v1", insecure=True)
    with pytest.raises(RegistryError, match="cannot reach the registry .* \\(https\\)"):
        packaged.pull(f"{registry.host}/team/tiny:v1")  # TLS to a plain-http registry fails; never falls back


def test_registry_down_or_silent_is_an_error_not_a_hang(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "home", download_limits=DownloadLimits(idle_seconds=1.0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RegistryError, match="cannot reach the registry"):
        store.pull(f"127.0.0.1:{port}/team/tiny:v1", insecure=True)
    silent = socket.socket()  # accepts connections and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    conns: list[socket.socket] = []
    threading.Thread(target=lambda: conns.append(silent.accept()[0]), daemon=True).start()
    try:
        with pytest.raises(RegistryError, match="did not answer in time"):
            store.pull(f"127.0.0.1:{silent.getsockname()[1]}/team/tiny:v1", insecure=True)
    finally:
        for c in conns:
            c.close()
        silent.close()


def test_pull_ollama_style_manifest(store: ModelStore, registry: Registry, tinycoder_gguf: Path,
                                    tmp_path: Path) -> None:
    """A registry mirroring Ollama's models: a Docker v2 manifest with vnd.ollama.image.* layers."""
    ref = parse_reference(f"{registry.host}/library/tinyllama:q8")
    files = {"model": tinycoder_gguf.read_bytes(), "template": b"{{ .Prompt }}", "params": b'{"stop":["</s>"]}',
             "license": b"MIT"}
    layers = []
    with RegistryClient(registry.host, credentials.Credentials(USER, PASSWORD), insecure=True) as client:
        for kind, data in files.items():
            path = tmp_path / kind
            path.write_bytes(data)
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            if not client.has_blob(ref, digest, push=True):
                client.upload(ref, digest, path, len(data))
            layers.append({"mediaType": f"application/vnd.ollama.image.{kind}", "digest": digest, "size": len(data)})
        config = json.dumps({"model_format": "gguf", "model_family": "llama"}).encode()
        (tmp_path / "config").write_bytes(config)
        config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
        client.upload(ref, config_digest, tmp_path / "config", len(config))
        manifest = json.dumps({"schemaVersion": 2, "mediaType": media.DOCKER_MANIFEST,
                               "config": {"mediaType": media.OLLAMA_CONFIG, "digest": config_digest,
                                          "size": len(config)}, "layers": layers}).encode()
        client.put_manifest(ref, manifest, media.DOCKER_MANIFEST)
    _login(store, registry)
    model = pull(store, str(ref), insecure=True)
    assert model.manifest["oci"]["kind"] == "ollama" and model.manifest["layout"] == "file"
    path = store.model_path(model)
    assert path.name == "model.gguf" and path.read_bytes() == files["model"]
    assert (path.parent / "template.txt").read_bytes() == files["template"]
    assert model.info.format == "gguf"


def test_registry_errors_carry_its_message(registry: Registry) -> None:
    """A manifest naming a blob the registry lacks is refused by the registry; its error code reaches the user."""
    ref = parse_reference(f"{registry.host}/team/broken:v1")
    body = json.dumps({"schemaVersion": 2, "mediaType": media.OCI_MANIFEST,
                       "config": {"mediaType": media.DMR_CONFIG_V01, "digest": "sha256:" + "0" * 64, "size": 2},
                       "layers": []}).encode()
    with RegistryClient(registry.host, credentials.Credentials(USER, PASSWORD), insecure=True) as client:
        with pytest.raises(RegistryError, match="HTTP 400 .*MANIFEST_BLOB_UNKNOWN"):
            client.put_manifest(ref, body, media.OCI_MANIFEST)


def test_folder_model_round_trip(store: ModelStore, registry: Registry, tiny_model, tmp_path: Path) -> None:
    """A safetensors folder: Model Runner's v0.2 layout (one layer per file) there and back, paths kept."""
    package(store, tiny_model("qwen2"), "qwen")
    _login(store, registry)
    push(store, "qwen", f"{registry.host}/team/qwen:v1", insecure=True)
    other = ModelStore(tmp_path / "other")
    _login(other, registry)
    model = other.pull(f"{registry.host}/team/qwen:v1", insecure=True)
    assert model.manifest["layout"] == "dir" and model.info.format == "safetensors"
    assert _files(other, "team/qwen:v1") == _files(store, "qwen")
    assert (other.model_path(model) / "config.json").is_file()


def test_split_gguf_round_trip(store: ModelStore, registry: Registry, tmp_path: Path) -> None:
    """A GGUF model split in shards: one ``gguf.v3`` layer per shard (the header's metadata from the first, as Model
    Runner's config), pulled back as the same files under their names, and served as one model."""
    from runlm.engine.llm import LLM
    from runlm.engine.types.sampling_params import SamplingParams
    from tests.fixtures.gguf_convert import converted_gguf, split_gguf

    package(store, split_gguf("llama"), "split")
    packed = store.get("split")
    shards = [f["path"] for f in packed.manifest["files"] if f["path"].endswith(".gguf")]
    assert len(shards) > 1
    layers = json.loads(store.blobs.path(packed.manifest["oci"]["manifest"]).read_bytes())["layers"]
    assert [la["mediaType"] for la in layers].count(media.DMR_GGUF) == len(shards)
    _login(store, registry)
    push(store, "split", f"{registry.host}/team/split:v1", insecure=True)
    other = ModelStore(tmp_path / "other")
    _login(other, registry)
    model = other.pull(f"{registry.host}/team/split:v1", insecure=True)
    assert _files(other, "team/split:v1") == _files(store, "split")
    assert model.info.architecture == "llama" and model.info.parameters == packed.info.parameters
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    served, whole = (LLM(str(p), max_model_len=256, kv_cache_memory="16MiB").generate(["Hello"], params)[0]
                     for p in (other.model_path(model), converted_gguf("llama")))
    assert served.outputs[0].token_ids == whole.outputs[0].token_ids
