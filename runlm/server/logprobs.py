"""Per-token logprobs in OpenAI's two shapes (chat: ``content`` entries; completions: parallel lists)."""
from __future__ import annotations

import math
from typing import Any

from runlm.engine.types.outputs import Logprob
from runlm.formats.tokenizer import Tokenizer, bytes_to_unicode

_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI and vLLM clamp the same way


def _lp(x: float) -> float:
    return x if math.isfinite(x) else _MIN_LOGPROB


class TokenTexts:
    """A token's own text and bytes, spaces included (``decode([id])`` drops SentencePiece's leading space)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.byte_level = "ByteLevel" in str(tokenizer.hf.decoder)
        self.unbyte = {c: b for b, c in bytes_to_unicode().items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tok.id_to_piece(token_id)
        if token_id in self.tok.special_ids:
            return piece.encode()
        if token_id in self.tok.byte_token_ids:  # SentencePiece byte fallback: <0xE2>
            return bytes([int(piece[3:5], 16)])
        if self.byte_level and all(c in self.unbyte for c in piece):
            return bytes(self.unbyte[c] for c in piece)
        return piece.replace("\u2581", " ").encode()

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k),
                    key=lambda x: x[1].rank or 0)  # every entry kept has a rank
    return ranked[:k]


def chat_logprobs(texts: TokenTexts, token_ids: list[int], entries: list[dict[int, Logprob]],
                  k: int) -> dict[str, Any]:
    content = []
    for tid, entry in zip(token_ids, entries):
        text, raw = texts.get(tid)
        top = []
        for t, lp in _top(entry, k):
            ttext, traw = texts.get(t)
            top.append({"token": ttext, "logprob": _lp(lp.logprob), "bytes": traw})
        content.append({"token": text, "logprob": _lp(entry[tid].logprob), "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(texts: TokenTexts, token_ids: list[int], entries: list[dict[int, Logprob] | None],
                        k: int, offset: int) -> dict[str, Any]:
    """``offset`` is where this piece's text starts in the choice's whole text."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for tid, entry in zip(token_ids, entries):
        text, _ = texts.get(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:  # the first prompt token has no logprob
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_lp(entry[tid].logprob))
        top = {texts.get(t)[0]: _lp(lp.logprob) for t, lp in _top(entry, k)}
        top.setdefault(text, _lp(entry[tid].logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
