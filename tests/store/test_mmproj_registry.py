"""A vision model's projector through a real registry (CNCF Distribution): ``runlm package --mmproj`` and push,
then pull on another store: the mmproj layer comes back as the file beside the GGUF, and an artifact laid out
as older Model Runner versions push it (layers without file names) reads the same way."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runlm.store import ModelStore
from runlm.store.capabilities import capabilities
from runlm.store.mmproj import DMR_MMPROJ
from runlm.store.oci import credentials, media
from runlm.store.oci.client import RegistryClient
from runlm.store.oci.reference import parse_reference
from runlm.store.oci.transfer import package, push
from tests.fixtures.registry import PASSWORD, USER, Registry
from tests.store.test_mmproj_store import write_projector


def _login(store: ModelStore, registry: Registry) -> None:
    credentials.save(registry.host, credentials.Credentials(USER, PASSWORD), store.home)


@pytest.fixture
def vlm_gguf(tmp_path: Path, tinycoder_gguf: Path) -> tuple[Path, Path]:
    folder = tmp_path / "files"
    folder.mkdir()
    shutil.copy(tinycoder_gguf, folder / "vlm.gguf")
    return folder / "vlm.gguf", write_projector(tmp_path / "mmproj-vlm-f16.gguf")


def test_package_push_pull_keeps_the_projector(store: ModelStore, registry: Registry, vlm_gguf: tuple[Path, Path],
                                               tmp_path: Path) -> None:
    gguf, proj = vlm_gguf
    package(store, gguf, "vlm", mmproj=proj)
    _login(store, registry)
    ref, digest = push(store, "vlm", f"{registry.host}/team/vlm:v1", insecure=True)
    with RegistryClient(registry.host, credentials.Credentials(USER, PASSWORD), insecure=True) as client:
        manifest = json.loads(client.get_manifest(ref).body)
    assert [la["mediaType"] for la in manifest["layers"]] == [media.DMR_GGUF, "application/vnd.docker.ai.mmproj"]
    other = ModelStore(tmp_path / "other")
    _login(other, registry)
    model = other.pull(f"{registry.host}/team/vlm:v1", insecure=True)
    assert model.manifest["layout"] == "file" and model.manifest["oci"]["manifest"] == digest
    assert model.mmproj == "mmproj-vlm-f16.gguf" and capabilities(model) == ["completion", "vision"]
    path = other.model_path(model)
    assert path.read_bytes() == gguf.read_bytes()
    assert other.mmproj_path(model) == path.parent / "mmproj-vlm-f16.gguf"
    assert other.mmproj_path(model).read_bytes() == proj.read_bytes()


def test_pull_of_unnamed_layers(store: ModelStore, registry: Registry, vlm_gguf: tuple[Path, Path],
                                tmp_path: Path) -> None:
    """Model Runner before file-path annotations: a gguf.v3 layer and an mmproj layer, neither named."""
    gguf, proj = vlm_gguf
    package(store, gguf, "vlm", mmproj=proj)
    model = store.get("vlm")
    body = json.loads(store.blobs.path(model.manifest["oci"]["manifest"]).read_bytes())
    for la in body["layers"]:
        la.pop("annotations", None)
    raw = json.dumps(body).encode()
    ref = parse_reference(f"{registry.host}/team/old:v1")
    with RegistryClient(registry.host, credentials.Credentials(USER, PASSWORD), insecure=True) as client:
        for blob in [body["config"], *body["layers"]]:
            client.upload(ref, blob["digest"], store.blobs.path(blob["digest"]), blob["size"], lambda n: None)
        client.put_manifest(ref, raw, media.OCI_MANIFEST)
    other = ModelStore(tmp_path / "other")
    _login(other, registry)
    pulled = other.pull(str(ref), insecure=True)
    assert [(f["path"], f.get("media_type")) for f in pulled.manifest["files"]] == \
        [("model.gguf", media.DMR_GGUF), ("model.mmproj", DMR_MMPROJ)]
    assert other.mmproj_path(pulled).read_bytes() == proj.read_bytes()
