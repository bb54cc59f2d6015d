"""The data-parallel router's prefix memory: chained block hashes of token-id and text prompts."""
from __future__ import annotations

from runlm.engine.parallel.router import BLOCK_CHARS, BLOCK_TOKENS, PrefixRouter, prefix_hashes


def test_block_hashes_chain_so_only_a_shared_prefix_matches() -> None:
    a = list(range(100, 100 + 3 * BLOCK_TOKENS + 5))
    b = a[:2 * BLOCK_TOKENS] + [7] * (BLOCK_TOKENS + 5)
    ha, hb = prefix_hashes({"prompt_token_ids": a}), prefix_hashes(b)
    assert len(ha) == 3 and len(hb) == 3  # the partial last block is not cached, so not counted
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    moved = [1] + a[1:]  # the same later blocks after a different first one: nothing shared
    assert not set(prefix_hashes(moved)) & set(ha)


def test_text_prompts_and_prompts_without_blocks() -> None:
    text = "x" * (2 * BLOCK_CHARS)
    assert len(prefix_hashes(text)) == 2 and prefix_hashes({"prompt": text}) == prefix_hashes(text)
    assert prefix_hashes("short") == [] and prefix_hashes({"image": object()}) == []


def test_the_router_remembers_what_it_sent_where() -> None:
    router = PrefixRouter()
    prompt = list(range(5 * BLOCK_TOKENS))
    router.record(1, prefix_hashes(prompt))
    router.record(0, prefix_hashes(prompt[:2 * BLOCK_TOKENS]))
    assert router.matched_blocks(1, prompt) == 5 and router.matched_blocks(0, prompt) == 2
    router.forget(0)
    assert router.matched_blocks(0, prompt) == 0 and router.matched_blocks(1, prompt) == 5
    router.clear()
    assert router.matched_blocks(1, prompt) == 0


def test_the_memory_is_bounded_oldest_first() -> None:
    router = PrefixRouter(capacity=4)
    prompt = list(range(5 * BLOCK_TOKENS))
    router.record(1, prefix_hashes(prompt))
    # the first block's hash was dropped: a chain without its first link matches nothing
    assert router.matched_blocks(1, prompt) == 0
    router.record(1, prefix_hashes(prompt[:BLOCK_TOKENS]))
    assert router.matched_blocks(1, prompt) == 1  # the first block is back, the second made room for it
