"""Pooler configs read from a model's own sentence-transformers files, and the pooling arithmetic."""
from __future__ import annotations

import json

import pytest
import torch

from runlm.formats import ModelFormatError
from runlm.models.pooling import finish_embedding, pool, read_pooler_config
from runlm.models.spec import model_task


def test_minilm_config(minilm_dir) -> None:
    cfg = read_pooler_config(minilm_dir, "cls", {})
    assert (cfg.mode, cfg.normalize, cfg.max_seq_length, cfg.matryoshka) == ("mean", True, 256, False)


def test_defaults_without_sentence_transformers_files(tmp_path) -> None:
    cfg = read_pooler_config(tmp_path, "last", {"matryoshka_dimensions": [64, 128]})
    assert (cfg.mode, cfg.normalize, cfg.max_seq_length, cfg.matryoshka) == ("last", True, None, True)


def _st_dir(tmp_path, pooling: dict, normalize: bool):
    modules = [{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def test_cls_without_normalize(tmp_path) -> None:
    cfg = read_pooler_config(_st_dir(tmp_path, {"pooling_mode_cls_token": True}, False), "last", {})
    assert (cfg.mode, cfg.normalize) == ("cls", False)


def test_newer_spelling(tmp_path) -> None:
    assert read_pooler_config(_st_dir(tmp_path, {"pooling_mode": "lasttoken"}, True), "cls", {}).mode == "last"


def test_unsupported_pooling_is_refused_clearly(tmp_path) -> None:
    with pytest.raises(ModelFormatError, match="not supported"):
        read_pooler_config(_st_dir(tmp_path, {"pooling_mode_max_tokens": True}, True), "cls", {})


def test_pool_modes() -> None:
    hidden = torch.arange(12, dtype=torch.float32).view(6, 2)  # sequences of 2 and 4 tokens
    assert pool(hidden, [2, 4], "cls").tolist() == [[0, 1], [4, 5]]
    assert pool(hidden, [2, 4], "last").tolist() == [[2, 3], [10, 11]]
    assert pool(hidden, [2, 4], "mean").tolist() == [[1, 2], [7, 8]]


def test_matryoshka_truncates_before_normalising() -> None:
    vec = torch.tensor([3.0, 4.0, 12.0])
    assert torch.allclose(finish_embedding(vec, True, 2), torch.tensor([0.6, 0.8]))
    assert finish_embedding(vec, False, None).tolist() == [3.0, 4.0, 12.0]


def test_model_task_from_files(minilm_dir, tiny_model) -> None:
    assert model_task(minilm_dir) == "embed"
    assert model_task(tiny_model("qwen3-embedding")) == "embed"
    assert model_task(tiny_model("llama-embedding")) == "embed"   # architectures: LlamaModel
    assert model_task(tiny_model("bert-cross-encoder")) == "score"
    assert model_task(tiny_model("qwen3-reranker")) == "score"
    assert model_task(tiny_model("qwen3-yes-no-reranker")) == "score"  # classifier_from_token
    assert model_task(tiny_model("qwen2")) == "generate"
