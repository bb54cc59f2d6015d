"""Which replica takes a request: the least loaded, unless one already caches the prompt's prefix.

The front end cannot see the replicas' prefix caches, so it remembers what it sent where: the prompt
is cut into fixed blocks (token ids, or characters of a text prompt), each block's hash chained to the
ones before it (as the engine's own prefix cache keys blocks), and each replica keeps the hashes of the
prompts routed to it (bounded, least recently used dropped first). A request goes to the replica that
holds its longest leading run of blocks, unless that replica's load (waiting + running) is more than a
margin above the least-loaded one's: then the prefix is worth less than the queue (vLLM's DP
coordinator balances on the same two counts). Ties go round-robin.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from runlm.engine.parallel.replica import EngineReplica

__all__ = ["PrefixRouter", "prefix_hashes"]

BLOCK_TOKENS = 16
BLOCK_CHARS = 64     # a text prompt's block: about 16 tokens of English


def prefix_hashes(prompt: Any) -> list[int]:
    """Chained hashes of the prompt's whole blocks (a partial last block is not cached, so not counted)."""
    if isinstance(prompt, Mapping):
        prompt = prompt.get("prompt_token_ids") or prompt.get("prompt") or ""
    items: str | tuple
    if isinstance(prompt, str):
        size, items = BLOCK_CHARS, prompt
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt[:1]):
        size, items = BLOCK_TOKENS, tuple(prompt)
    else:  # images, pairs for scoring...: no affinity, load alone decides
        return []
    hashes, parent = [], 0
    for start in range(0, len(items) - size + 1, size):
        parent = hash((parent, items[start:start + size]))
        hashes.append(parent)
    return hashes


class PrefixRouter:
    def __init__(self, margin: int = 4, capacity: int = 200_000) -> None:
        """``margin``: how many more queued requests than the least-loaded replica a prefix is worth
        (plus a quarter of that replica's load); ``capacity``: block hashes remembered per replica."""
        self.margin, self.capacity = margin, capacity
        self._seen: dict[int, OrderedDict[int, None]] = {}
        self._turn = itertools.count()

    def choose(self, prompt: Any, candidates: Sequence[EngineReplica]) -> tuple[EngineReplica, list[int]]:
        """The replica for this prompt and the prompt's block hashes (pass them to ``record``)."""
        if not candidates:
            raise ValueError("no replica to route to")
        hashes = prefix_hashes(prompt)
        loads = {r.rank: r.load().total for r in candidates}
        least = min(loads.values())
        best, best_len = None, 0
        for r in candidates:
            n = self._matched(r.rank, hashes)
            if n > best_len or (n == best_len and best is not None and loads[r.rank] < loads[best.rank]):
                best, best_len = r, n
        if best is not None and best_len and loads[best.rank] <= least + self.margin + least // 4:
            return best, hashes
        idle = [r for r in candidates if loads[r.rank] == least]
        return idle[next(self._turn) % len(idle)], hashes

    def record(self, rank: int, hashes: list[int]) -> None:
        seen = self._seen.setdefault(rank, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def matched_blocks(self, rank: int, prompt: Any) -> int:
        return self._matched(rank, prefix_hashes(prompt))

    def forget(self, rank: int) -> None:
        """The replica restarted or left: its cache is gone."""
        self._seen.pop(rank, None)

    def clear(self) -> None:
        """Every prefix cache was reset."""
        self._seen.clear()

    def _matched(self, rank: int, hashes: list[int]) -> int:
        seen = self._seen.get(rank)
        if not seen:
            return 0
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n
