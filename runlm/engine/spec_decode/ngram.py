"""Prompt lookup (n-gram) proposals: find the sequence's last n tokens earlier in itself and propose
what followed them there. No second model; useful where the output repeats the input (quoting,
rewriting code, extraction). vLLM's ``prompt_lookup_min`` / ``prompt_lookup_max``: the longest
suffix from max down to min that occurs earlier wins, at its latest occurrence with k tokens after it.

It runs after every step for every decoding sequence, so it is one pass over the tokens: the earlier
positions holding the last token, narrowed one token back at a time to those the suffix still matches."""
from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        n_tokens = len(token_ids)
        if k < 1 or n_tokens < self.lookup_min + 1:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        # the earlier positions (not the last) where a match of the suffix ends, for n = 1, 2, ...
        ends = np.flatnonzero(ids[:-1] == ids[-1])
        found = ends if self.lookup_min <= 1 else ends[:0]
        for n in range(2, min(self.lookup_max, n_tokens - 1) + 1):
            ends = ends[ends >= n - 1]
            ends = ends[ids[ends - (n - 1)] == ids[-n]]
            if not ends.size:
                break
            if n >= self.lookup_min:
                found = ends  # the longest match wins
        if not found.size:
            return []
        follow = found + 1  # where what followed each occurrence starts
        # the latest occurrence that is followed by k tokens, else the one with the longest continuation
        full = follow[follow + k <= n_tokens]
        start = int(full[-1] if full.size else follow[0])
        return token_ids[start:start + k]
