"""The engine's image bookkeeping on its own: where chunks stop, how image blocks are keyed in the prefix
cache, which batch rows take an image's embeddings, M-RoPE positions, the encoder cache and the
bidirectional mask. (End to end through real vision models: tests/engine/test_vision_engine.py.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runlm.engine.core.encoder_cache import EncoderCache
from runlm.engine.core.kv_cache import BlockManager, BlockTable
from runlm.engine.core.mm_step import mrope_positions, step_images
from runlm.engine.core.scheduler import SchedulerOutput
from runlm.engine.core.sequence import Sequence
from runlm.engine.types.sampling_params import SamplingParams
from runlm.models.attention import _mask
from runlm.models.vision.inputs import ImageFeature, MultiModalPrompt, content_hash


def feature(start: int, n: int, key: bytes = b"a", bidirectional: bool = False) -> ImageFeature:
    return ImageFeature(content_hash(key), np.arange(start, start + n, dtype=np.int64), {}, bidirectional)


def seq_with(features: list[ImageFeature], length: int = 40) -> Sequence:
    seq = Sequence("r", 0, list(range(length)), length, SamplingParams())
    seq.mm = MultiModalPrompt(list(range(length)), features)
    return seq


def test_chunks_stop_before_a_bidirectional_image_or_take_it_whole() -> None:
    seq = seq_with([feature(10, 8, bidirectional=True)])
    assert seq.chunk_end(0, 12) == 10      # would split the image: stop before it
    assert seq.chunk_end(0, 10) == 10 and seq.chunk_end(0, 18) == 18 and seq.chunk_end(0, 25) == 25
    assert seq.chunk_end(10, 12) == 18     # starts at the image: the whole image, over the budget
    assert seq.chunk_end(14, 16) == 18     # starts inside it (a prefix-cache hit ended there): to its end
    assert seq.chunk_end(0, 40) == 40      # the whole prompt
    assert seq_with([]).chunk_end(0, 12) == 12
    assert seq_with([feature(10, 8)]).chunk_end(0, 12) == 12  # a causal model's image may be split


def test_image_blocks_are_keyed_by_the_image() -> None:
    ids = list(range(40))
    blocks = BlockManager(16, 4)
    first = BlockTable(mm_keys=((8, 16, bytes.fromhex(content_hash(b"cat"))),))
    assert blocks.allocate_prompt(first, ids, 64) == 40
    blocks.commit_full_blocks(first, ids, 40)
    same = (8, 16, bytes.fromhex(content_hash(b"cat")))
    other = (8, 16, bytes.fromhex(content_hash(b"dog")))
    assert len(blocks.match_prefix(ids, None, (same,))) == 9  # every full block but the last token's
    assert len(blocks.match_prefix(ids, None, (other,))) == 2  # the text before the other image only
    assert len(blocks.match_prefix(ids, None)) == 2


def test_step_rows_and_bidirectional_spans() -> None:
    a, b = feature(4, 6, b"a", bidirectional=True), feature(20, 3, b"b")
    seq1, seq2 = seq_with([a, b]), Sequence("t", 0, list(range(10)), 10, SamplingParams())
    seq1.num_computed_tokens = 6  # this step computes 6..22 of seq1, after all 10 of seq2
    sched = SchedulerOutput([seq2, seq1], [10, 16])
    images = step_images(sched)
    assert images is not None
    assert images.rows.tolist() == [10, 11, 12, 13, 24, 25]  # a's positions 6..9, b's 20..21
    assert [(f.hash, idx.tolist()) for f, idx in images.parts] == [(a.hash, [2, 3, 4, 5]), (b.hash, [0, 1])]
    assert images.bidirectional == [[], [(4, 10)]]
    assert step_images(SchedulerOutput([seq2], [10])) is None


def test_mrope_positions_continue_after_the_prompt() -> None:
    seq = seq_with([feature(2, 4)], length=8)
    assert seq.mm is not None
    seq.mm.mrope_positions = np.array([[0, 1, 2, 2, 2, 2, 4, 5], [0, 1, 2, 2, 3, 3, 4, 5], [0, 1, 2, 3, 2, 3, 4, 5]])
    seq.mm.mrope_delta = -2
    seq.token_ids += [100, 101]
    seq.num_computed_tokens = 6
    plain = Sequence("t", 0, [1, 2, 3], 3, SamplingParams())
    out = mrope_positions(SchedulerOutput([plain, seq], [3, 4]), 7)
    assert out.tolist() == [[0, 1, 2, 4, 5, 6, 7]] * 3


def test_encoder_cache_runs_each_image_once() -> None:
    cache, calls = EncoderCache(max_bytes=2 * 4 * 8 * 4), []

    def encode(features: list[ImageFeature]) -> list[torch.Tensor]:
        calls.append([f.hash for f in features])
        return [torch.full((f.num_embeds, 8), float(f.start)) for f in features]

    a, b, c = feature(0, 4, b"a"), feature(10, 4, b"b"), feature(20, 4, b"c")
    out = cache.embeddings([a, b, a], encode)
    assert calls == [[a.hash, b.hash]] and [float(e[0, 0]) for e in out] == [0, 10, 0]
    cache.embeddings([b, a], encode)
    assert len(calls) == 1 and cache.images_encoded == 2 and cache.hits == 2
    cache.embeddings([c], encode)  # over 2 images' worth: the least recently used (b) goes
    cache.embeddings([b], encode)
    assert calls[1:] == [[c.hash], [b.hash]] and cache.images_encoded == 4
    cache.reset()
    assert cache.embeddings([a], encode) and cache.images_encoded == 5


def test_encoder_cache_refuses_a_tower_that_miscounts() -> None:
    with pytest.raises(RuntimeError, match="rows"):
        EncoderCache().embeddings([feature(0, 4)], lambda fs: [torch.zeros(3, 2) for _ in fs])


def test_bidirectional_mask() -> None:
    mask = _mask(6, 8, None, torch.device("cpu"), [(3, 6)])  # queries at positions 2..7
    assert mask is not None
    want = torch.tril(torch.ones(8, 8, dtype=torch.bool))[2:]
    want[1:4, 3:6] = True  # positions 3..5 see each other
    assert torch.equal(mask, want)
