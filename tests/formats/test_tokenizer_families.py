"""SentencePiece vocabularies of Gemma GGUF files read as transformers reads them (tokenizer.ggml.model "llama",
architecture gemma2: no prefix space, spaces spelled by a normalizer, merges in file order)."""
from __future__ import annotations

import pytest
import sentencepiece as spm
from transformers import AutoTokenizer

from runlm.formats.gguf import GGUFFile
from runlm.formats.tokenizer import Tokenizer
from runlm.models.evaluate import english_text
from tests.fixtures.gguf_convert import gemma_sentencepiece_gguf

TEXTS = ["Hello world", " Hello  world", "The def statement\n\tdefines a function.", "   three leading",
         "naïve café ☕ 日本語", "x = [i ** 2 for i in range(10)]  # squares", english_text()[:3000]]


@pytest.fixture(scope="module")
def gemma_gguf():
    return gemma_sentencepiece_gguf()


def test_gemma_sentencepiece_vocabulary_encodes_as_transformers(gemma_gguf) -> None:
    gguf = GGUFFile(gemma_gguf)
    assert gguf.metadata["tokenizer.ggml.model"] == "llama" and gguf.architecture == "gemma2"
    ours = Tokenizer.from_gguf(gguf)
    theirs = AutoTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)
    sentencepiece = spm.SentencePieceProcessor(model_file=str(gemma_gguf.parent / "tokenizer.model"))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ids == [2, *sentencepiece.encode(text)], text  # <bos>, then the model the file was written from
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
