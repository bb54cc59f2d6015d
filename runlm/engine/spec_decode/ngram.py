"""Prompt lookup (n-gram) proposals: find the sequence's last n tokens earlier in itself and propose
what followed them there. No second model; useful where the output repeats the input (quoting,
rewriting code, extraction). vLLM's ``prompt_lookup_min`` / ``prompt_lookup_max``: the longest
suffix from max down to min that occurs earlier wins, at its latest occurrence with k tokens after it."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        n_tokens = len(token_ids)
        if k < 1 or n_tokens < self.lookup_min + 1:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.lookup_max, n_tokens - 1), self.lookup_min - 1, -1):
            suffix = ids[-n:]
            # windows starting at 0 .. n_tokens - n - 1: every occurrence but the suffix itself
            windows = sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                # the latest occurrence that is followed by k tokens, else the one with the longest continuation
                full = hits[hits + n + k <= n_tokens]
                start = int(full[-1] if full.size else hits[0]) + n
                return token_ids[start:start + k]
        return []
