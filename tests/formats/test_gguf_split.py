"""Split GGUF models (``<name>-00001-of-0000N.gguf``, as llama.cpp's gguf-split and its converter's
``--split-max-tensors`` write big files): given the first file, its shards are found beside it and read as one model,
by the loaders, both runners and the store's inspection; a later shard, a missing one or a foreign one is refused by
name."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from runlm.formats import ModelFormatError
from runlm.formats.gguf import GGUFFile
from runlm.models.evaluate import all_logits
from runlm.models.load import load_decoder
from runlm.quantize import QuantizeError, quantize_file
from runlm.store.inspect import inspect_model
from tests.fixtures.gguf_convert import converted_gguf, split_gguf
from tests.models.test_llama import _prompt


def test_the_shards_read_as_the_one_file() -> None:
    first, whole = GGUFFile(split_gguf("llama")), GGUFFile(converted_gguf("llama"))
    assert len(first.maps) == 3 and {t.part for t in first.tensors.values()} == {0, 1, 2}
    assert set(first.tensors) == set(whole.tensors)
    assert all((first.raw(n) == whole.raw(n)).all() for n in whole.tensors)
    assert inspect_model(split_gguf("llama")).parameters == inspect_model(converted_gguf("llama")).parameters


def test_a_split_model_computes_as_the_whole_one_on_both_runners() -> None:
    ids = _prompt(49152, 40)
    split, whole = (load_decoder(p, exact_numerics=True) for p in (split_gguf("llama"), converted_gguf("llama")))
    assert torch.equal(all_logits(split.model, ids), all_logits(whole.model, ids))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = [LLM(str(p), max_model_len=256, kv_cache_memory="16MiB").generate([{"prompt_token_ids": ids}], params)
            for p in (split_gguf("llama"), converted_gguf("llama"))]
    assert outs[0][0].outputs[0].token_ids == outs[1][0].outputs[0].token_ids


def test_a_later_missing_or_foreign_shard_is_refused_by_name(tmp_path: Path) -> None:
    first = split_gguf("llama")
    second = first.with_name(first.name.replace("-00001-", "-00002-"))
    with pytest.raises(ModelFormatError, match="this is file 2 of a split model: give the first, llama-00001-of-00003"):
        GGUFFile(second)
    for shard in first.parent.glob("*.gguf"):
        shutil.copy(shard, tmp_path / shard.name)
    (tmp_path / "llama-00003-of-00003.gguf").unlink()
    with pytest.raises(ModelFormatError, match="file 3 of the split model, llama-00003-of-00003.gguf, is missing"):
        GGUFFile(tmp_path / first.name)
    renamed = tmp_path / "model.gguf"
    shutil.copy(first, renamed)
    with pytest.raises(ModelFormatError, match="not named <name>-00001-of-00003.gguf"):
        GGUFFile(renamed)
    with pytest.raises(QuantizeError, match="split in several"):
        quantize_file(first, tmp_path / "q.gguf", "Q8_0")


def test_the_store_keeps_every_shard_under_its_name(tmp_path: Path) -> None:
    from runlm.store import ModelStore

    store = ModelStore(tmp_path / "home")
    stored = store.pull(str(split_gguf("llama")), name="split")
    assert [f["path"] for f in stored.manifest["files"]] == [f"llama-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    path = store.model_path(stored)
    assert path.name == "llama-00001-of-00003.gguf" and stored.info.parameters == \
        inspect_model(converted_gguf("llama")).parameters
    ids = _prompt(49152, 20)
    assert torch.equal(all_logits(load_decoder(path, exact_numerics=True).model, ids),
                       all_logits(load_decoder(converted_gguf("llama"), exact_numerics=True).model, ids))


def test_a_daemons_local_import_takes_every_shard_under_the_allowed_folder(tmp_path: Path) -> None:
    from runlm.store import ModelStore
    from runlm.store.sources import LocalAccess, SourceError

    allowed = tmp_path / "imports"
    allowed.mkdir()
    for shard in split_gguf("llama").parent.glob("*.gguf"):
        shutil.copy(shard, allowed / shard.name)
    store = ModelStore(tmp_path / "home")
    stored = store.pull("llama-00001-of-00003.gguf", name="split", access=LocalAccess.under(allowed))
    assert [f["path"] for f in stored.manifest["files"]] == [f"llama-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert load_decoder(store.model_path(stored), exact_numerics=True).config.num_layers == 2
    outside = tmp_path / "outside.gguf"
    (allowed / "llama-00003-of-00003.gguf").rename(outside)
    (allowed / "llama-00003-of-00003.gguf").symlink_to(outside)  # a shard that leads out of the folder
    with pytest.raises(SourceError, match="leaves the folder local imports are allowed from"):
        ModelStore(tmp_path / "home2").pull("llama-00001-of-00003.gguf", name="out", access=LocalAccess.under(allowed))
