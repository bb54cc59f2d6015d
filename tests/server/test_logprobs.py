"""Token text and bytes for logprobs: byte-level BPE (smollm2) and SentencePiece with byte fallback (tinycoder)."""
from __future__ import annotations

import pytest

from runlm.formats.gguf import GGUFFile
from runlm.formats.tokenizer import Tokenizer
from runlm.server.logprobs import TokenTexts


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "tinycoder_gguf"])
def test_token_bytes_join_to_the_utf8_text(fixture: str, request) -> None:
    tok = Tokenizer.from_gguf(GGUFFile(request.getfixturevalue(fixture)))
    texts = TokenTexts(tok)
    ids = tok.encode("héllo 😀 world", add_special_tokens=False)
    joined = b"".join(bytes(texts.get(i)[1]) for i in ids)
    # SentencePiece adds a leading space to the first word; everything else is byte-exact
    assert joined.decode("utf-8").lstrip(" ") == "héllo 😀 world"
    assert any("\ufffd" in texts.get(i)[0] for i in ids)  # the emoji spans several tokens
    if tok.eos_token:
        assert texts.get(tok.eos_token_id) == (tok.eos_token, list(tok.eos_token.encode()))
