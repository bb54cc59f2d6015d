"""Pairing rules for scores (vLLM's ``LLM.score``) and the embedding-model fallback (cosine similarity)."""
from __future__ import annotations

from collections.abc import Sequence

from runlm.engine.types.outputs import PoolingOutput, PoolingRequestOutput


class ScoreInputError(ValueError):
    """The two sides of a score request cannot be paired."""


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """One text against each of the others (1 x N), or pairwise (N x N)."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds:
        raise ScoreInputError("both sides of a score request need at least one text")
    if len(firsts) == 1:
        return [(firsts[0], s) for s in seconds]
    if len(firsts) != len(seconds):
        raise ScoreInputError(f"text_1 has {len(firsts)} texts and text_2 has {len(seconds)}: give one text_1, "
                              f"or as many as text_2")
    return list(zip(firsts, seconds))


def cosine_output(a: PoolingRequestOutput, b: PoolingRequestOutput) -> PoolingRequestOutput:
    """The score of a pair for an embedding model: the cosine similarity of its two embeddings."""
    import torch.nn.functional as F  # (the vectors are torch's: a pooling model ran)

    score = F.cosine_similarity(a.outputs.data, b.outputs.data, dim=0).reshape(1)
    return PoolingRequestOutput(f"{a.request_id}+{b.request_id}", PoolingOutput(score),
                                a.prompt_token_ids + b.prompt_token_ids, True,
                                a.num_truncated_tokens + b.num_truncated_tokens)
