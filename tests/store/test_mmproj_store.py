"""Multimodal projectors in the store: found beside a GGUF, given with --mmproj, packaged as Model Runner's
``vnd.docker.ai.mmproj`` layer, read back from a manifest, and handed to the engine launcher as a path."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from runlm.formats import ModelFormatError
from runlm.store import ModelStore
from runlm.store.capabilities import capabilities, input_modalities
from runlm.store.mmproj import DMR_MMPROJ, choose_projector
from runlm.store.oci import artifact, media
from runlm.store.oci.transfer import package
from runlm.store.sources import LocalAccess


def write_projector(path: Path, arch: str = "clip", seed: int = 0) -> Path:
    """A small GGUF with a projector's header (what convert_hf_to_gguf.py --mmproj writes: architecture clip)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("clip.projector_type", "idefics3")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_tensor("mm.model.fc.weight", np.random.default_rng(seed).standard_normal((8, 16)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def vlm_folder(tmp_path: Path, tinycoder_gguf: Path) -> Path:
    """llama.cpp users' layout: the text GGUF and mmproj-<name>.gguf side by side."""
    folder = tmp_path / "smolvlm"
    folder.mkdir()
    shutil.copy(tinycoder_gguf, folder / "SmolVLM-Q8_0.gguf")
    write_projector(folder / "mmproj-SmolVLM-f16.gguf")
    return folder


def _entry(model, path: str) -> dict:
    return next(f for f in model.manifest["files"] if f["path"] == path)


def test_choose_projector_by_name() -> None:
    assert choose_projector("m.gguf", ["m.gguf", "mmproj-m-f16.gguf", "README.md"]) == "mmproj-m-f16.gguf"
    assert choose_projector("m.gguf", ["m.gguf", "x.gguf"]) is None
    names = ["Qwen-Q4.gguf", "SmolVLM-Q8.gguf", "mmproj-Qwen-f16.gguf", "mmproj-SmolVLM-f16.gguf"]
    assert choose_projector("SmolVLM-Q8.gguf", names) == "mmproj-SmolVLM-f16.gguf"
    assert choose_projector("other.gguf", ["other.gguf", "mmproj-a.gguf", "mmproj-b.gguf"]) is None  # can't tell


def test_local_gguf_keeps_the_projector_beside_it(store: ModelStore, vlm_folder: Path) -> None:
    model = store.pull(str(vlm_folder / "SmolVLM-Q8_0.gguf"), "vlm")
    assert model.manifest["layout"] == "file" and model.manifest["files"][0]["path"] == "model.gguf"
    assert model.mmproj == "mmproj-SmolVLM-f16.gguf"
    assert _entry(model, model.mmproj)["media_type"] == DMR_MMPROJ
    path, proj = store.model_path(model), store.mmproj_path(model)
    assert path.name == "model.gguf" and proj == path.parent / "mmproj-SmolVLM-f16.gguf"
    assert proj.read_bytes() == (vlm_folder / "mmproj-SmolVLM-f16.gguf").read_bytes()
    assert "vision" in capabilities(model) and input_modalities(model) == ["text", "image"]
    # the text model alone (no projector beside it) is a text model
    plain = store.pull(str(_alone(vlm_folder)), "plain")
    assert plain.mmproj is None and store.mmproj_path(plain) is None
    assert "vision" not in capabilities(plain) and input_modalities(plain) == ["text"]


def _alone(folder: Path) -> Path:
    other = folder.parent / "alone"
    other.mkdir(exist_ok=True)
    shutil.copy(folder / "SmolVLM-Q8_0.gguf", other / "model.gguf")
    return other / "model.gguf"


def test_a_projector_added_later_makes_a_new_pull(store: ModelStore, vlm_folder: Path) -> None:
    proj = vlm_folder / "mmproj-SmolVLM-f16.gguf"
    kept = proj.rename(vlm_folder.parent / "kept.gguf")
    first = store.pull(str(vlm_folder / "SmolVLM-Q8_0.gguf"), "vlm")
    assert first.mmproj is None
    kept.rename(proj)
    assert store.pull(str(vlm_folder / "SmolVLM-Q8_0.gguf"), "vlm").mmproj == proj.name


def test_a_gguf_named_mmproj_that_is_no_projector_is_left_out(store: ModelStore, vlm_folder: Path) -> None:
    (vlm_folder / "mmproj-SmolVLM-f16.gguf").unlink()
    write_projector(vlm_folder / "mmproj-SmolVLM-f16.gguf", arch="llama")
    assert store.pull(str(vlm_folder / "SmolVLM-Q8_0.gguf"), "vlm").mmproj is None


def test_explicit_mmproj(store: ModelStore, vlm_folder: Path, tmp_path: Path) -> None:
    other = write_projector(tmp_path / "proj.gguf", seed=1)
    model = store.pull(str(vlm_folder / "SmolVLM-Q8_0.gguf"), "vlm", mmproj=other)
    projectors = [f for f in model.manifest["files"] if f.get("media_type") == DMR_MMPROJ]
    # the given one replaces the one found beside, under a name the engine's own search finds
    assert [f["path"] for f in projectors] == ["mmproj-proj.gguf"]
    assert store.mmproj_path(model).read_bytes() == other.read_bytes()
    assert store.get("vlm").mmproj == "mmproj-proj.gguf"
    from runlm.models.vision.mmproj import find_mmproj

    assert find_mmproj(store.model_path(model)) == store.mmproj_path(model)
    with pytest.raises(ModelFormatError, match="not a multimodal projector"):
        store.pull(str(vlm_folder / "SmolVLM-Q8_0.gguf"), "vlm", mmproj=vlm_folder / "SmolVLM-Q8_0.gguf")
    with pytest.raises(ModelFormatError, match="no such file"):
        store.pull(str(vlm_folder / "SmolVLM-Q8_0.gguf"), "vlm", mmproj=tmp_path / "nope.gguf")


def test_a_projector_alone_is_no_model(store: ModelStore, vlm_folder: Path) -> None:
    with pytest.raises(ModelFormatError, match="multimodal projector"):
        store.pull(str(vlm_folder / "mmproj-SmolVLM-f16.gguf"), "p")


def test_daemon_import_under_allowed_folder_keeps_the_projector(store: ModelStore, vlm_folder: Path) -> None:
    access = LocalAccess.under(vlm_folder.parent)
    model = store.pull("smolvlm/SmolVLM-Q8_0.gguf", "vlm", access=access)
    assert model.mmproj == "mmproj-SmolVLM-f16.gguf"
    assert store.mmproj_path(model).read_bytes() == (vlm_folder / "mmproj-SmolVLM-f16.gguf").read_bytes()


def test_package_writes_the_mmproj_layer(store: ModelStore, vlm_folder: Path, tmp_path: Path) -> None:
    proj = write_projector(tmp_path / "mmproj-given.gguf", seed=2)
    model = package(store, vlm_folder / "SmolVLM-Q8_0.gguf", "team/vlm:v1", mmproj=proj)
    manifest = json.loads(store.blobs.path(model.manifest["oci"]["manifest"]).read_bytes())
    assert manifest["config"]["mediaType"] == media.DMR_CONFIG_V01
    types = [la["mediaType"] for la in manifest["layers"]]
    assert types == [media.DMR_GGUF, "application/vnd.docker.ai.mmproj"]
    layer = manifest["layers"][1]
    assert layer["digest"] == "sha256:" + hashlib.sha256(proj.read_bytes()).hexdigest()
    assert layer["annotations"][media.ANNOTATION_FILEPATH] == "mmproj-given.gguf"
    # read back, the manifest is a one-file model with its projector beside it
    plan = artifact.plan(manifest)
    assert plan.layout == "file" and plan.layers[0].media_type == media.DMR_GGUF
    assert [la.path for la in plan.layers if la.media_type == DMR_MMPROJ] == ["mmproj-given.gguf"]


def test_plan_reads_model_runner_and_ollama_projectors() -> None:
    def layer(mtype: str, n: int, path: str | None = None) -> dict:
        d = {"mediaType": mtype, "digest": "sha256:" + f"{n:064x}", "size": 10}
        if path:
            d["annotations"] = {media.ANNOTATION_FILEPATH: path}
        return d

    for layers in ([layer(media.DMR_GGUF, 1), layer(media.DMR_MMPROJ, 2)],  # older Model Runner: no names
                   [layer(media.DMR_GGUF, 1, "m.gguf"), layer(media.DMR_MMPROJ, 2, "mmproj-m-f16.gguf")]):
        plan = artifact.plan({"config": {"mediaType": media.DMR_CONFIG_V01}, "layers": layers})
        assert plan.layout == "file" and plan.kind == "docker-model-runner"
        assert plan.layers[1].media_type == DMR_MMPROJ and plan.layers[1].path in ("model.mmproj", "mmproj-m-f16.gguf")
    plan = artifact.plan({"config": {"mediaType": media.OLLAMA_CONFIG},
                          "layers": [layer(media.OLLAMA_PREFIX + "model", 1), layer(media.OLLAMA_PREFIX + "projector", 2)]})
    assert plan.layout == "file" and [la.path for la in plan.layers] == ["model.gguf", "mmproj.gguf"]


def test_hugging_face_gguf_repos_bring_the_projector() -> None:
    from runlm.store.sources import hf_patterns

    files = ["README.md", "SmolVLM-256M-Instruct-Q8_0.gguf", "SmolVLM-256M-Instruct-f16.gguf",
             "mmproj-SmolVLM-256M-Instruct-Q8_0.gguf", "mmproj-SmolVLM-256M-Instruct-f16.gguf"]
    assert hf_patterns(files, "f16", "ggml-org/SmolVLM") == ["SmolVLM-256M-Instruct-f16.gguf",
                                                           "mmproj-SmolVLM-256M-Instruct-f16.gguf"]
    # the weights, never the projector, even where its name sorts first
    assert hf_patterns(["qwen2.5-vl-q4_0.gguf", "mmproj-model-f16.gguf"], None, "o/q") == \
        ["qwen2.5-vl-q4_0.gguf", "mmproj-model-f16.gguf"]
    assert hf_patterns(["m/a-q4_0.gguf", "m/mmproj-a.gguf", "b.gguf"], "a-q4", "o/m") == \
        ["m/a-q4_0.gguf", "m/mmproj-a.gguf"]
    assert hf_patterns(["plain-q4_0.gguf"], None, "o/p") == ["plain-q4_0.gguf"]


def test_a_plain_pull_after_an_explicit_projector_is_text_only(store: ModelStore, vlm_folder: Path,
                                                               tmp_path: Path) -> None:
    (vlm_folder / "mmproj-SmolVLM-f16.gguf").unlink()
    store.pull(str(vlm_folder / "SmolVLM-Q8_0.gguf"), "vlm", mmproj=write_projector(tmp_path / "p.gguf"))
    assert store.pull(str(vlm_folder / "SmolVLM-Q8_0.gguf"), "text").mmproj is None
    assert store.get("vlm").mmproj == "mmproj-p.gguf"
