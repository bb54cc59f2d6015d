"""The store with real model files: pulls, content addressing, refs, metadata, removal."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from runlm.store import ModelNotFoundError, ModelStore
from runlm.store.progress import PullProgress
from runlm.store.sources import SourceError


def test_pull_builtin_gguf_records_metadata(store: ModelStore, tinycoder_gguf: Path) -> None:
    events: list[PullProgress] = []
    model = store.pull("tinycoder", progress=events.append)
    assert str(model.name) == "tinycoder:latest"
    info = model.info
    assert (info.format, info.architecture, info.quantization) == ("gguf", "llama", "F16")
    assert info.context_length == 2048 and info.parameters > 1_000_000
    assert model.size == tinycoder_gguf.stat().st_size
    assert model.id.startswith("sha256:") and len(model.id) == 71
    # progress: byte counts that reach the total, then success
    sizes = [e for e in events if e.total]
    assert sizes[-1].completed == sizes[-1].total == tinycoder_gguf.stat().st_size
    assert events[-1].status == "success"
    # the backend's view is the same bytes under a normal file name
    path = store.model_path(model)
    assert path.suffix == ".gguf" and path.read_bytes() == tinycoder_gguf.read_bytes()


def test_smollm2_metadata_has_template_and_q4(store: ModelStore) -> None:
    model = store.pull("smollm2")
    info = model.info
    assert info.quantization == "Q4_1" and info.parameter_size == "135M" and info.context_length == 8192
    assert "im_start" in (info.template or "")
    assert info.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 4


def test_pull_safetensors_directory(store: ModelStore, minilm_dir: Path) -> None:
    model = store.pull(str(minilm_dir), name="minilm-local")
    assert model.info.format == "safetensors" and model.info.capabilities == ["embedding"]
    view = store.model_path(model)
    assert view.is_dir()
    assert (view / "config.json").read_text() == (minilm_dir / "config.json").read_text()
    assert (view / "1_Pooling" / "config.json").exists()  # sub-folders are kept


def test_identical_content_is_stored_once(store: ModelStore, tinycoder_gguf: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tinycoder_gguf.read_bytes())
    a = store.pull("tinycoder")
    b = store.pull(str(copy), name="other:v1")
    assert a.id == b.id
    assert len(store.blobs.digests()) == 1
    assert sorted(str(m.name) for m in store.list()) == ["other:v1", "tinycoder:latest"]


def test_tag_rm_and_garbage_collection(store: ModelStore) -> None:
    store.pull("tinycoder")
    store.tag("tinycoder", "mine/coder:v2")
    assert store.get("mine/coder:v2").id == store.get("tinycoder").id
    store.remove("tinycoder")
    assert len(store.blobs.digests()) == 1  # still used by the other tag
    store.remove("mine/coder:v2")
    assert store.blobs.digests() == set() and store.list() == []
    assert not (store.manifests / "mine").exists()  # empty namespaces go too
    with pytest.raises(ModelNotFoundError, match="pull it first"):
        store.get("tinycoder")


def test_df_and_purge(store: ModelStore, tinycoder_gguf: Path) -> None:
    store.pull("tinycoder")
    assert store.disk_usage()["models"] == tinycoder_gguf.stat().st_size
    assert store.purge() >= tinycoder_gguf.stat().st_size
    assert store.list() == [] and store.disk_usage() == {"models": 0, "partial": 0}


def test_second_pull_of_same_source_is_up_to_date(store: ModelStore) -> None:
    first = store.pull("tinycoder")
    events: list[PullProgress] = []
    again = store.pull("tinycoder", progress=events.append)
    assert again.id == first.id
    assert not any(e.total for e in events)  # nothing copied the second time


def test_not_a_model_is_refused_and_nothing_listed(store: ModelStore, tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(Exception, match="GGUF"):
        store.pull(str(junk))
    assert store.list() == []
    with pytest.raises(SourceError, match="cannot pull"):
        store.pull("./no/such/file.gguf")


def test_manifests_are_json_and_refs_cannot_escape(store: ModelStore) -> None:
    store.pull("tinycoder", name="a/b:c")
    ref = store.manifests / "a" / "b" / "c"
    assert json.loads(ref.read_text())["files"][0]["path"].endswith(".gguf")
    with pytest.raises(ValueError):
        store.tag("a/b:c", "../../outside")
    assert not (store.home.parent / "outside").exists()
    assert all(Path(root).resolve().is_relative_to(store.home.resolve()) for root, _, _ in os.walk(store.home))
