"""runlm.kernels.paged_attention: matches SDPA, and a row's result is bitwise independent of the batch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runlm.kernels import attention as attn


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    if not attn.available():
        pytest.skip("runlm attention kernel unavailable (CPU without AVX2/FMA, or no C++ compiler/ninja)")


def _cache(slots: int, kvh: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, kvh, d, generator=g), torch.randn(slots, kvh, d, generator=g)


def _slots(n: int, total: int, seed: int) -> torch.Tensor:
    """n distinct cache slots in scrambled order, as a paged block table produces."""
    return torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:n]


def _reference(q, k_cache, v_cache, slots, query_lens, context_lens, scale, window):
    out, start, s0 = [], 0, 0
    for ql, cl in zip(query_lens, context_lens):
        idx = slots[s0:s0 + cl]
        ks, vs = k_cache[idx].transpose(0, 1), v_cache[idx].transpose(0, 1)
        qpos = torch.arange(cl - ql, cl)[:, None]
        kpos = torch.arange(cl)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        o = F.scaled_dot_product_attention(q[start:start + ql].transpose(0, 1).double(), ks.double(), vs.double(),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out.append(o.transpose(0, 1).float())
        start, s0 = start + ql, s0 + cl
    return torch.cat(out)


@pytest.mark.parametrize("heads,kv_heads,dim,window", [(4, 2, 16, None), (14, 2, 64, None), (9, 3, 64, None),
                                                        (4, 4, 20, None), (8, 2, 32, 5), (2, 1, 128, 17)])
def test_matches_sdpa(heads, kv_heads, dim, window):
    k_cache, v_cache = _cache(512, kv_heads, dim)
    query_lens, context_lens = [1, 7, 1, 33, 1], [1, 40, 90, 33, 3]
    slots = torch.cat([_slots(c, 512, i) for i, c in enumerate(context_lens)])
    q = torch.randn(sum(query_lens), heads, dim, generator=torch.Generator().manual_seed(1))
    scale = dim ** -0.5
    out = attn.paged_attention(q, k_cache, v_cache, slots, query_lens, context_lens, scale, window)
    ref = _reference(q, k_cache, v_cache, slots, query_lens, context_lens, scale, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 9])
def test_soft_capped_scores_match_gemma2s_attention(window):
    from runlm.kernels.triton.reference import causal_mask, explicit_attention

    heads, kv_heads, dim, cap = 8, 2, 32, 5.0
    k_cache, v_cache = _cache(256, kv_heads, dim, seed=4)
    query_lens, context_lens = [1, 12, 1], [30, 12, 70]
    slots = torch.cat([_slots(c, 256, i) for i, c in enumerate(context_lens)])
    q = 4 * torch.randn(sum(query_lens), heads, dim, generator=torch.Generator().manual_seed(2))  # scores past the cap
    out = attn.paged_attention(q, k_cache, v_cache, slots, query_lens, context_lens, dim ** -0.5, window, cap)
    ref, start, s0 = [], 0, 0
    for ql, cl in zip(query_lens, context_lens):
        idx = slots[s0:s0 + cl]
        ks, vs = k_cache[idx].transpose(0, 1).double(), v_cache[idx].transpose(0, 1).double()
        o = explicit_attention(q[start:start + ql].transpose(0, 1).double(), ks, vs,
                               causal_mask(ql, cl, window, q.device), dim ** -0.5, cap, None)
        ref.append(o.transpose(0, 1).float())
        start, s0 = start + ql, s0 + cl
    torch.testing.assert_close(out, torch.cat(ref), rtol=1e-5, atol=1e-5)
    plain = attn.paged_attention(q, k_cache, v_cache, slots, query_lens, context_lens, dim ** -0.5, window)
    assert not torch.allclose(out, plain, atol=1e-3)  # the cap changed the result


def test_row_is_batch_and_chunk_invariant():
    """The same sequence alone, among others, and with its prompt cut into chunks: identical bits."""
    heads, kvh, dim = 14, 2, 64
    k_cache, v_cache = _cache(1024, kvh, dim, seed=3)
    own = _slots(100, 1024, 7)
    g = torch.Generator().manual_seed(5)
    q_own = torch.randn(100, heads, dim, generator=g)
    alone = attn.paged_attention(q_own, k_cache, v_cache, own, [100], [100], 0.125)
    # the prompt in two chunks: rows 0..59, then rows 60..99 with the first 60 already cached
    first = attn.paged_attention(q_own[:60], k_cache, v_cache, own[:60], [60], [60], 0.125)
    second = attn.paged_attention(q_own[60:], k_cache, v_cache, own, [40], [100], 0.125)
    assert torch.equal(torch.cat([first, second]), alone)
    # decode of the last row among 31 other sequences of other lengths, in the middle of the batch
    others = [int(n) for n in torch.randint(1, 300, (31,), generator=g)]
    lens = others[:12] + [100] + others[12:]
    slots = torch.cat([_slots(n, 1024, 100 + i) if i != 12 else own for i, n in enumerate(lens)])
    q = torch.randn(32, heads, dim, generator=g)
    q[12] = q_own[99]
    batched = attn.paged_attention(q, k_cache, v_cache, slots, [1] * 32, lens, 0.125)
    assert torch.equal(batched[12], alone[99])


def test_thread_count_does_not_change_bits():
    k_cache, v_cache = _cache(256, 2, 64, seed=9)
    slots = _slots(200, 256, 1)
    q = torch.randn(200, 8, 64, generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attn.paged_attention(q, k_cache, v_cache, slots, [200], [200], 0.125)
        torch.set_num_threads(2)
        two = attn.paged_attention(q, k_cache, v_cache, slots, [200], [200], 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_uncovered_inputs_return_none():
    k_cache, v_cache = _cache(16, 1, 8)
    q = torch.randn(1, 1, 8, dtype=torch.float64)
    assert attn.paged_attention(q, k_cache, v_cache, torch.arange(1), [1], [1], 1.0) is None


def test_inconsistent_lengths_raise():
    k_cache, v_cache = _cache(16, 1, 8)
    with pytest.raises(RuntimeError, match="lengths"):
        attn.paged_attention(torch.randn(2, 1, 8), k_cache, v_cache, torch.arange(3), [2], [4], 1.0)
