"""`runlm package`: Model Runner's OCI artifact written into the store (no registry needed)."""
from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from runlm.store import ModelStore
from runlm.store.oci import artifact, credentials, media
from runlm.store.oci.artifact import ArtifactError
from runlm.store.oci.reference import InvalidReferenceError, looks_like_reference, parse_reference
from runlm.store.oci.transfer import package


def _blob_json(store: ModelStore, digest: str) -> dict:
    data = store.blobs.path(digest).read_bytes()
    assert "sha256:" + hashlib.sha256(data).hexdigest() == digest
    return json.loads(data)


def test_package_gguf_uses_model_runner_types(store: ModelStore, tinycoder_gguf: Path, tmp_path: Path) -> None:
    lic = tmp_path / "LICENSE.txt"
    lic.write_text("Apache-2.0\n")
    model = package(store, tinycoder_gguf, "team/tiny:v1", (lic,), context_size=512)
    oci = model.manifest["oci"]
    manifest = _blob_json(store, oci["manifest"])
    assert manifest["schemaVersion"] == 2 and manifest["mediaType"] == media.OCI_MANIFEST
    assert manifest["config"]["mediaType"] == "application/vnd.docker.ai.model.config.v0.1+json"
    types = [la["mediaType"] for la in manifest["layers"]]
    assert types == ["application/vnd.docker.ai.gguf.v3", "application/vnd.docker.ai.license"]
    gguf_layer = manifest["layers"][0]
    assert gguf_layer["size"] == tinycoder_gguf.stat().st_size
    assert gguf_layer["digest"] == "sha256:" + hashlib.sha256(tinycoder_gguf.read_bytes()).hexdigest()
    assert gguf_layer["annotations"][media.ANNOTATION_FILEPATH] == "model.gguf"
    config = _blob_json(store, manifest["config"]["digest"])
    assert config["config"]["format"] == "gguf" and config["config"]["architecture"] == "llama"
    assert config["config"]["quantization"] == "F16" and config["config"]["context_size"] == 512
    assert config["config"]["gguf"]["general.architecture"] == "llama"
    assert config["rootfs"] == {"type": "rootfs", "diff_ids": [la["digest"] for la in manifest["layers"]]}
    # the model still runs from the store: its path is the GGUF file, the license beside it
    path = store.model_path(store.get("team/tiny:v1"))
    assert path.read_bytes() == tinycoder_gguf.read_bytes() and (path.parent / "LICENSE.txt").read_text() == "Apache-2.0\n"


def test_package_folder_is_v02_one_layer_per_file(store: ModelStore, tiny_model) -> None:
    folder = tiny_model("qwen2")
    model = package(store, folder, "qwen-tiny")
    manifest = _blob_json(store, model.manifest["oci"]["manifest"])
    assert manifest["config"]["mediaType"] == "application/vnd.docker.ai.model.config.v0.2+json"
    by_path = {la["annotations"][media.ANNOTATION_FILEPATH]: la["mediaType"] for la in manifest["layers"]}
    assert by_path["model.safetensors"] == "application/vnd.docker.ai.safetensors"
    assert by_path["config.json"] == "application/vnd.docker.ai.model.file"
    assert manifest["layers"][0]["mediaType"] == "application/vnd.docker.ai.safetensors"  # weights first
    assert _blob_json(store, manifest["config"]["digest"])["config"]["format"] == "safetensors"


def test_removing_the_model_frees_its_oci_blobs(store: ModelStore, tinycoder_gguf: Path) -> None:
    model = package(store, tinycoder_gguf, "tiny")
    oci = model.manifest["oci"]
    assert store.blobs.has(oci["manifest"]) and store.blobs.has(oci["config"])
    store.remove("tiny")
    assert store.blobs.digests() == set()


def test_bad_context_size_and_missing_license_are_refused(store: ModelStore, tinycoder_gguf: Path,
                                                          tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="context-size"):
        package(store, tinycoder_gguf, "tiny", context_size=0)
    with pytest.raises(ValueError, match="does not exist"):
        package(store, tinycoder_gguf, "tiny", (tmp_path / "nope",))


def test_references() -> None:
    ref = parse_reference("localhost:5000/team/tiny:v1")
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == ("localhost:5000", "team/tiny", "v1", None)
    assert parse_reference("docker.io/smollm2").repository == "library/smollm2"
    assert parse_reference("docker.io/ai/smollm2").api_host == "registry-1.docker.io"
    d = "sha256:" + "a" * 64
    assert parse_reference(f"oci://reg.example/m@{d}").target == d
    assert looks_like_reference("127.0.0.1:5000/m") and looks_like_reference("ghcr.io/org/m:1")
    # Hugging Face ids and paths stay what they were
    assert not looks_like_reference("HuggingFaceTB/SmolLM2-135M") and not looks_like_reference("./m.gguf")
    assert not looks_like_reference("hf.co/TestOrg/Tiny-GGUF:f16")
    for bad in ("localhost:5000/UPPER", "reg.io/../x", "reg.io/m:bad tag", "reg.io/m@sha256:short"):
        with pytest.raises(InvalidReferenceError):
            parse_reference(bad)


def test_manifest_paths_cannot_leave_the_model() -> None:
    gguf = {"mediaType": media.DMR_GGUF, "digest": "sha256:" + "b" * 64, "size": 1}
    for bad in ("../x.gguf", "/etc/x.gguf", "a/../../x.gguf", ".hidden.gguf"):
        layer = {**gguf, "annotations": {media.ANNOTATION_FILEPATH: bad}}
        with pytest.raises(ArtifactError):
            artifact.plan({"config": {"mediaType": media.DMR_CONFIG_V02}, "layers": [layer]})
    with pytest.raises(ArtifactError, match="no GGUF or safetensors"):
        artifact.plan({"config": {}, "layers": [{"mediaType": "text/plain", "digest": gguf["digest"], "size": 1}]})


def test_ollama_manifest_plan() -> None:
    def layer(kind: str, c: str) -> dict:
        return {"mediaType": f"application/vnd.ollama.image.{kind}", "digest": "sha256:" + c * 64, "size": 3}
    plan = artifact.plan({"mediaType": media.DOCKER_MANIFEST, "config": {"mediaType": media.OLLAMA_CONFIG},
                          "layers": [layer("template", "a"), layer("model", "b"), layer("params", "c"),
                                     layer("license", "d"), layer("future-kind", "e")]})
    assert plan.kind == "ollama" and plan.layout == "file"
    assert [la.path for la in plan.layers] == ["model.gguf", "template.txt", "params.json", "LICENSE"]


def test_login_file_is_private_and_docker_config_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    home = tmp_path / "home"
    assert credentials.lookup("reg.example", home) is None
    path = credentials.save("reg.example", credentials.Credentials("me", "pw"), home)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert credentials.lookup("reg.example", home) == credentials.Credentials("me", "pw")
    assert "pw" not in repr(credentials.lookup("reg.example", home))
    (tmp_path / "docker").mkdir()
    (tmp_path / "docker/config.json").write_text(json.dumps({"auths": {"https://other.example": {"auth": "dTpwdw=="}}}))
    assert credentials.lookup("other.example", home) == credentials.Credentials("u", "pw")
    assert credentials.forget("reg.example", home) and credentials.lookup("reg.example", home) is None


def test_docker_credential_helper_is_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Docker's credential-helper protocol: `docker-credential-NAME get`, the registry on stdin. The helper here is
    a stand-in script (the real ones talk to a desktop keychain)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    helper = bin_dir / "docker-credential-teststore"
    helper.write_text('#!/bin/sh\nread host\n[ "$1" = get ] && [ "$host" = helped.example ] && '
                      'echo \'{"ServerURL":"helped.example","Username":"hu","Secret":"hs"}\' && exit 0\n'
                      'echo "credentials not found in native keychain"; exit 1\n')
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    (tmp_path / "docker").mkdir()
    (tmp_path / "docker/config.json").write_text(json.dumps({"credsStore": "teststore"}))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    assert credentials.lookup("helped.example", tmp_path / "home") == credentials.Credentials("hu", "hs")
    assert credentials.lookup("other.example", tmp_path / "home") is None
    (tmp_path / "docker/config.json").write_text(json.dumps({"credHelpers": {"helped.example": "../../bin/sh"}}))
    assert credentials.lookup("helped.example", tmp_path / "home") is None  # a helper name is a name, not a path
