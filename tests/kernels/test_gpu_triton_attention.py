"""The Triton paged kernels (runlm/kernels/triton): under Triton's interpreter on the CPU (small shapes), compiled
for an H100 ahead of time (no GPU needed), and run on CUDA where there is one; against the torch reference and
per-sequence SDPA.

One process cannot hold both: triton.jit decides at decoration time, Triton's own library included (interpreted
kernels need it interpreted, compiled ones compiled). So ``test_kernels_under_interpreter`` runs this file's
``test_interpreted_*`` in a child pytest with TRITON_INTERPRET=1; here they skip unless that is set.
"""
from __future__ import annotations

import os
import types

import pytest
import torch
import torch.nn.functional as F

from runlm.kernels import triton as rtriton
from runlm.kernels.triton import reference
from tests.fixtures.triton_checks import compile_for_h100, run_interpreted

pytestmark = pytest.mark.skipif(not rtriton.available(), reason="triton is not installed")
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRETING
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
compiled = pytest.mark.skipif(INTERPRETING, reason="TRITON_INTERPRET is set: kernels are interpreted here")


def test_kernels_under_interpreter():
    run_interpreted(__file__)


@pytest.mark.slow
def test_families_end_to_end_under_interpreter():
    run_interpreted(__file__, "-k", "interpreted_families", "-m", "slow")


@pytest.mark.slow  # (interpreted end to end: test_families_end_to_end_under_interpreter runs it)
@pytest.mark.parametrize("recipe", ["gpt-oss", "llama4-text", "deepseek-v2"])
def test_interpreted_families_on_the_gpu_runner(tiny_model, monkeypatch, recipe):
    """The kernel's sinks (gpt-oss, with RoPE and the K/V store in one launch before it), chunks (Llama 4: prompts
    crossing its 16-position chunks) and latents (DeepSeek: one KV head that is its own V) end to end: the GPU
    runner's greedy tokens, its attention interpreted, equal the torch runner's exact mode."""
    if not INTERPRETING:
        pytest.skip("runs in test_families_end_to_end_under_interpreter's child process")
    from runlm.engine.types.sampling_params import SamplingParams
    from tests.engine.conftest import prompt_ids
    from tests.fixtures.triton_checks import runner_tokens

    def on_triton(llm) -> None:
        assert llm.engine.runner.backend.use_triton

    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt_ids(9 + 11 * i, seed=i)} for i in range(2)]
    tokens = runner_tokens(monkeypatch, tiny_model(recipe), prompts, greedy, on_triton)
    assert tokens[True] == tokens[False]


@pytest.fixture(scope="module")
def interp() -> types.SimpleNamespace:
    if not INTERPRETING:
        pytest.skip("runs in test_kernels_under_interpreter's child process")
    from runlm.kernels.triton.attention import paged_attention
    from runlm.kernels.triton.kv_store import store_kv
    return types.SimpleNamespace(paged_attention=paged_attention, store_kv=store_kv)


# ---------------------------------------------------------------- a step's worth of paged data

def _step(seqs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int = 16,
          dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0, spare_blocks: int = 3):
    """seqs: (new tokens, context length after the step) per sequence. K/V of every context position are already
    in the cache (blocks scattered), q is random. Returns q, caches, block_table, cu_seqlens_q, seq_lens."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [(n + block_size - 1) // block_size for _, n in seqs]
    num_blocks = sum(per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(seqs), max(per_seq) + 1), -1, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(per_seq):
        table[b, :nb] = order[used:used + nb].int()
        used += nb
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    num_tokens = sum(q for q, _ in seqs)
    q = torch.randn(num_tokens, heads, head_dim, generator=g)
    cu = torch.tensor([0] + [sum(q for q, _ in seqs[:i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    lens = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    to = dict(device=device)
    return (q.to(dtype).to(**to), k_cache.to(dtype).to(**to), v_cache.to(dtype).to(**to), table.to(**to),
            cu.to(**to), lens.to(**to))


def _sdpa_per_sequence(q, k_cache, v_cache, table, cu, lens, scale, window=None, softcap=None, sinks=None,
                       chunk=None):
    """An independent check: each sequence's K/V made contiguous, explicit fp64 math for softcap and sinks, SDPA
    otherwise."""
    out = torch.zeros_like(q, dtype=torch.float64)
    bs = k_cache.shape[1]
    for b in range(len(lens)):
        start, end, n = int(cu[b]), int(cu[b + 1]), int(lens[b])
        blocks = [int(x) for x in table[b, :(n + bs - 1) // bs]]
        ks = torch.cat([k_cache[x] for x in blocks])[:n].double().transpose(0, 1)
        vs = torch.cat([v_cache[x] for x in blocks])[:n].double().transpose(0, 1)
        qs = q[start:end].double().transpose(0, 1)
        q_pos = torch.arange(n - (end - start), n, device=q.device)[:, None]
        k_pos = torch.arange(n, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window:
            mask &= k_pos > q_pos - window
        if chunk:
            mask &= k_pos // chunk == q_pos // chunk
        if softcap or sinks is not None:
            rep = qs.shape[0] // ks.shape[0]
            s = (qs @ ks.repeat_interleave(rep, 0).transpose(1, 2)) * scale
            s = torch.tanh(s / softcap) * softcap if softcap else s
            e = torch.exp(s.masked_fill(~mask, float("-inf")))
            total = e.sum(-1, keepdim=True) + (0 if sinks is None else torch.exp(sinks.double()).view(-1, 1, 1))
            o = (e / total) @ vs.repeat_interleave(rep, 0)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out


# a 1-token decode, a prefill chunk starting mid-context (crossing blocks), a whole prefill; and a long decode
MIXED = [(1, 37), (9, 40), (18, 18), (1, 16)]
CASES = [(None, None), (8, None), (None, 5.0), (13, 30.0)]


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4)], ids=["gqa4", "mha"])
@pytest.mark.parametrize(("window", "softcap"), CASES, ids=["causal", "window", "softcap", "window+softcap"])
def test_interpreted_attention_matches_reference_fp32(interp, heads, kv_heads, window, softcap):
    q, kc, vc, table, cu, lens = _step(MIXED, heads, kv_heads, 32)
    scale = 32 ** -0.5
    out = interp.paged_attention(q, kc, vc, table, cu, lens, scale, window, softcap)
    ref = reference.paged_attention_ref(q, kc, vc, table, cu, lens, scale, window, softcap)
    assert (out - ref).abs().max() <= 1e-5
    exact = _sdpa_per_sequence(q, kc, vc, table, cu, lens, scale, window, softcap)
    assert (out.double() - exact).abs().max() <= 1e-5


@pytest.mark.parametrize(("sinks", "chunk", "window", "segments"), [
    (True, None, None, 1), (True, None, 8, 4), (False, 16, None, 1), (True, 8, None, 2)],
    ids=["sinks", "sinks+window+split", "chunk", "sinks+chunk+split"])
def test_interpreted_sinks_and_chunks(interp, sinks, chunk, window, segments):
    """gpt-oss's attention sinks (a logit per head in the denominator) and Llama 4's chunked local attention: a
    decode past a chunk's end, a prefill crossing chunks, a whole prefill."""
    q, kc, vc, table, cu, lens = _step(MIXED, 8, 2, 32, seed=3)
    logits = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -3.0, 0.25, 4.0]) if sinks else None
    out = interp.paged_attention(q, kc, vc, table, cu, lens, 0.2, window, None, num_segments=segments,
                                 sinks=logits, chunk=chunk)
    ref = reference.paged_attention_ref(q, kc, vc, table, cu, lens, 0.2, window, None, sinks=logits, chunk=chunk)
    assert (out - ref).abs().max() <= 1e-5
    exact = _sdpa_per_sequence(q, kc, vc, table, cu, lens, 0.2, window, None, logits, chunk)
    assert (out.double() - exact).abs().max() <= 1e-5
    if sinks:  # the sinks took weight: the same step without them differs
        assert (out - interp.paged_attention(q, kc, vc, table, cu, lens, 0.2, window)).abs().max() > 1e-2


@pytest.mark.parametrize(("seqs", "window", "softcap", "segments"), [
    ([(1, 100), (1, 37), (1, 5), (1, 64)], None, None, 4),   # decodes: some segments get no tiles
    (MIXED, 13, 30.0, 2),                                    # split-KV is right for prefill rows too
], ids=["decode", "mixed-window-softcap"])
def test_interpreted_split_kv(interp, seqs, window, softcap, segments):
    q, kc, vc, table, cu, lens = _step(seqs, 8, 2, 32, seed=6)
    out = interp.paged_attention(q, kc, vc, table, cu, lens, 0.2, window, softcap, num_segments=segments)
    ref = reference.paged_attention_ref(q, kc, vc, table, cu, lens, 0.2, window, softcap)
    assert (out - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("rows", [16, 64])
def test_interpreted_odd_group_and_head_dim(interp, rows):
    """3 query heads per KV head (rows past BLOCK_Q * 3 idle), a head_dim that is no power of two; 16 rows per
    program, and 64 (21 query tokens of a prefill)."""
    q, kc, vc, table, cu, lens = _step([(3, 20), (1, 5), (30, 40)], 6, 2, 24, seed=1)
    out = interp.paged_attention(q, kc, vc, table, cu, lens, 0.3, 8, block_rows=rows)
    assert (out - reference.paged_attention_ref(q, kc, vc, table, cu, lens, 0.3, 8)).abs().max() <= 1e-5


@pytest.mark.parametrize(("heads", "segments"), [(16, 1), (48, 4)])
def test_interpreted_latent_attention(interp, heads, segments):
    """DeepSeek's latent attention (runlm.models.mla) as the GPU runner runs it: the heads' absorbed queries against
    one KV head of 16 + 8-value latents (a head_dim that is no power of two), V the very same cache tensor; the
    output's first 16 values are the latent-space values. Decodes and prefills: 16 heads in one pass; 48 heads in 3
    programs of 16 (backend.latent_heads: the one latent head seen as 3 of stride 0), split-KV."""
    from runlm.kernels.triton.backend import latent_heads

    q, kc, _, table, cu, lens = _step(MIXED, heads, 1, 24, seed=7)
    seen = latent_heads(kc, heads)
    assert seen.shape[2] == heads // 16 and (heads == 16 or seen.stride(2) == 0)
    out = interp.paged_attention(q, seen, seen, table, cu, lens, 24 ** -0.5, num_segments=segments)
    exact = _sdpa_per_sequence(q, kc, kc.clone(), table, cu, lens, 24 ** -0.5)
    assert (out.double() - exact).abs().max() <= 1e-5
    assert (out[..., :16] - reference.paged_attention_ref(q, kc, kc, table, cu, lens, 24 ** -0.5)[..., :16]
            ).abs().max() <= 1e-5


def test_interpreted_attention_bf16(interp):
    q, kc, vc, table, cu, lens = _step(MIXED, 8, 2, 32, dtype=torch.bfloat16, seed=2)
    out = interp.paged_attention(q, kc, vc, table, cu, lens, 32 ** -0.5, None, 20.0)
    assert out.dtype == torch.bfloat16
    exact = _sdpa_per_sequence(q, kc, vc, table, cu, lens, 32 ** -0.5, None, 20.0)
    assert (out.double() - exact).abs().max() <= 3e-2


def test_interpreted_released_blocks_and_padding(interp):
    """A window sequence whose first blocks were given back (-1 in its table), a padded launch (an extra sequence
    with no new tokens, extra rows): the real rows are right, the padding rows are never written."""
    q, kc, vc, table, cu, lens = _step([(2, 50), (1, 9)], 4, 2, 16, block_size=4, seed=3)
    # block 0 among the released: an entry of -1 read as a block id would land in it
    for b, i in (table == 0).nonzero().tolist():
        table[b, i] = table[0, 8]
    table[0, 8] = 0
    released = table[0, :9].long()
    table[0, :9] = -1  # positions 0..35: outside a window of 10 for queries at 48 and 49 (a tile reads 32..63)
    ref = reference.paged_attention_ref(q, kc, vc, table, cu, lens, 0.25, 10)
    kc[released], vc[released] = float("nan"), float("nan")  # what released blocks may hold by now: never read
    pad_q = torch.cat([q, torch.randn(3, *q.shape[1:])])
    pad_cu = torch.cat([cu, cu[-1:]])
    pad_lens = torch.cat([lens, torch.zeros(1, dtype=torch.int32)])
    pad_table = torch.cat([table, torch.zeros_like(table[:1])])
    for segments in (1, 2):
        out = torch.full_like(pad_q, 7.0)
        interp.paged_attention(pad_q, kc, vc, pad_table, pad_cu, pad_lens, 0.25, 10, out=out, num_segments=segments)
        assert (out[:3] - ref).abs().max() <= 1e-5
        assert bool((out[3:] == 7.0).all())


def _check_store(store_kv, device: str) -> None:
    """Strided K/V (slices of a fused projection), a -1 slot stores nothing; same dtype, and fp32 into bf16."""
    g = torch.Generator().manual_seed(4)
    kv_heads, head_dim, bs = 2, 24, 16
    fused = torch.randn(5, 3 * kv_heads * head_dim, generator=g).view(5, 3 * kv_heads, head_dim).to(device)
    slots = torch.tensor([17, 3, -1, 40, 63], device=device)
    keep = slots >= 0
    for src, dst in [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                     (torch.float32, torch.bfloat16)]:
        k, v = fused[:, kv_heads:2 * kv_heads].to(src), fused[:, 2 * kv_heads:].to(src)
        kc = torch.zeros(4, bs, kv_heads, head_dim, dtype=dst, device=device)
        vc = torch.zeros_like(kc)
        store_kv(k, v, kc, vc, slots)
        flat = torch.zeros(4 * bs, kv_heads, head_dim, dtype=dst, device=device)
        want_k = flat.index_copy(0, slots[keep], k[keep].to(dst))
        want_v = flat.index_copy(0, slots[keep], v[keep].to(dst))
        got_k, got_v = kc.view(-1, kv_heads, head_dim), vc.view(-1, kv_heads, head_dim)
        if src == dst or device == "cuda":
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        else:  # the interpreter rounds fp32 -> bf16 toward zero, CUDA to nearest: one bf16 step apart at most
            assert torch.allclose(got_k.float(), want_k.float(), rtol=2 ** -7, atol=0)
            assert torch.allclose(got_v.float(), want_v.float(), rtol=2 ** -7, atol=0)
        ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
        reference.store_kv_ref(k, v, ref_k, ref_v, slots)
        assert torch.equal(ref_k.view_as(want_k), want_k) and torch.equal(ref_v.view_as(want_v), want_v)


def test_interpreted_kv_store_matches_index_copy(interp):
    _check_store(interp.store_kv, "cpu")


def _check_fp8_cache(store_kv, paged_attention, device: str) -> None:
    """--kv-cache-dtype fp8: K/V stored as float8 e4m3 (encoded by the kernel itself: values past +-448 saturate,
    the rest round to nearest even) equal torch's cast; the attention kernel reads the fp8 cache as the
    per-sequence fp64 reference does the same bytes decoded."""
    g = torch.Generator().manual_seed(8)
    heads, kv_heads, d, bs = 4, 2, 32, 16
    f8 = torch.float8_e4m3fn
    seqs = [(3, 3), (5, 5)]  # two prefills: every context position stored this step
    q, _, _, table, cu, lens = _step(seqs, heads, kv_heads, d, block_size=bs, seed=8)
    k, v = (torch.randn(8, kv_heads, d, generator=g) * 30 for _ in range(2))
    k[0, 0, :3] = torch.tensor([600.0, -1000.0, 447.9])  # past e4m3's range: saturated
    slots = torch.tensor([int(table[b, p // bs]) * bs + p % bs for b, (n, _) in enumerate(seqs) for p in range(n)])
    kc, vc = (torch.zeros(int(table.max()) + 1, bs, kv_heads, d, dtype=f8) for _ in range(2))
    ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
    to = dict(device=device)
    kc, vc = kc.to(**to), vc.to(**to)
    store_kv(k.to(**to), v.to(**to), kc, vc, slots.to(**to))
    reference.store_kv_ref(k, v, ref_k, ref_v, slots)
    got, want = kc.cpu().float(), ref_k.float()
    first = int(slots[0])
    assert got.view(-1, kv_heads, d)[first, 0, :3].tolist() == want.view(-1, kv_heads, d)[first, 0, :3].tolist() \
        == [448.0, -448.0, 448.0]
    assert torch.equal(got, want) and torch.equal(vc.cpu().float(), ref_v.float())
    tiny = torch.tensor([2 ** -10, 3 * 2 ** -10, 2 ** -6 - 2 ** -11, 31.0, 33.0, -0.3])  # subnormals, ties, carries
    small = torch.zeros(1, bs, 1, 6, dtype=f8).to(**to)
    store_kv(tiny.view(1, 1, 6).to(**to), tiny.view(1, 1, 6).to(**to), small, small.clone(), torch.tensor([0]).to(**to))
    assert small.cpu().float()[0, 0, 0].tolist() == tiny.to(f8).float().tolist()
    out = paged_attention(q.to(**to), kc, vc, table.to(**to), cu.to(**to), lens.to(**to), d ** -0.5)
    exact = _sdpa_per_sequence(q, kc.cpu().float(), vc.cpu().float(), table, cu, lens, d ** -0.5)
    assert (out.cpu().double() - exact).abs().max() <= 2e-6 * exact.abs().max()  # (fp32's rounding of V ~ 100)


def test_interpreted_fp8_cache(interp):
    _check_fp8_cache(interp.store_kv, interp.paged_attention, "cpu")


# ---------------------------------------------------------------- the backend

def _two_steps(backend_factory):
    """A prefill of two sequences (5 and 12 tokens), a step decoding one while the other's chunk goes on, then a
    decode of both."""
    from runlm.kernels.triton.backend import PagedAttentionBackend
    g = torch.Generator().manual_seed(5)
    backend: PagedAttentionBackend = backend_factory()
    heads, kv_heads, d, bs = 4, 2, 16, 16
    table = torch.tensor([[3, 0], [1, 5]], dtype=torch.int32)

    def slots(b, start, end):
        return torch.tensor([int(table[b, p // bs]) * bs + p % bs for p in range(start, end)])

    outs = []
    for (s0, e0), (s1, e1) in [((0, 5), (0, 12)), ((5, 6), (12, 20)), ((6, 7), (20, 21))]:  # the last: split-KV
        n = (e0 - s0) + (e1 - s1)
        cu = torch.tensor([0, e0 - s0, n], dtype=torch.int32)
        backend.set_step(table, cu, torch.tensor([e0, e1], dtype=torch.int32),
                         torch.cat([slots(0, s0, e0), slots(1, s1, e1)]), max_query_len=max(e0 - s0, e1 - s1))
        assert backend.num_segments() == (16 if n == 2 else 1)
        for layer in range(2):
            q, k, v = (torch.randn(n, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
            outs.append(backend.forward(layer, q, k, v, 0.25, None if layer == 0 else 4, None))
    return backend, outs


def test_interpreted_backend_matches_reference_path(interp, monkeypatch):
    from runlm.kernels.triton import backend as backend_module
    assert backend_module.use_triton_on(torch.device("cpu"))  # TRITON_INTERPRET=1 here
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not backend_module.use_triton_on(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def make(use_triton):
        return lambda: backend_module.PagedAttentionBackend(2, 6, 16, 2, 16, torch.float32, "cpu", max_num_seqs=4,
                                                            max_num_tokens=32, max_blocks_per_seq=4,
                                                            use_triton=use_triton)
    tri, tri_out = _two_steps(make(True))
    ref, ref_out = _two_steps(make(False))
    for a, b in zip(tri_out, ref_out):
        assert (a - b).abs().max() <= 1e-5
    for (ka, va), (kb, vb) in zip(tri.caches, ref.caches):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_backend_through_write_kv_and_attend():
    """A model layer reaches the backend through the forward context, and a padded step's -1 slots write nothing."""
    from runlm.kernels.triton.backend import PagedAttentionBackend
    from runlm.models.attention import ForwardContext, forward_context, write_kv_and_attend
    backend = PagedAttentionBackend(1, 2, 16, 1, 8, torch.float32, "cpu", max_num_seqs=2, max_num_tokens=8,
                                    max_blocks_per_seq=2, use_triton=False)
    backend.set_step(torch.tensor([[1]], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
                     torch.tensor([3], dtype=torch.int32), torch.tensor([16, 17, 18, -1]))
    q, k, v = torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    with forward_context(ForwardContext([3], [3], None, None, None, backend=backend)):
        out = write_kv_and_attend(0, q, k, v, 0.5)
    want = reference.attend_one(q[:3], k[:3], v[:3], 0.5, None, None)
    assert torch.equal(out[:3], want)
    k_cache = backend.flat_caches()[0][0]
    assert torch.equal(k_cache[16:19], k[:3]) and not k_cache[19].any() and not k_cache[:16].any()


# ---------------------------------------------------------------- compiled: for an H100 on the CPU, then on CUDA

@compiled
@pytest.mark.skipif(CUDA, reason="with CUDA the kernels are compiled and run below")
def test_kernels_compile_for_sm90():
    """The interpreter runs Python, not Triton's compiler: compile both kernels ahead of time for an H100 (no GPU
    needed; ptxas ships in the triton wheel), so a kernel that only the compiler rejects fails here."""
    import runlm.kernels.triton.attention as attention
    import runlm.kernels.triton.kv_store as kv_store
    kernel = attention._unified_attention_kernel
    for dtype, window, softcap, segments, rows, sinks, chunk in [
            ("bf16", 0, False, 1, 16, False, 0), ("fp32", 128, True, 1, 16, False, 0),
            ("bf16", 0, False, 16, 16, False, 0), ("bf16", 0, False, 1, 64, False, 0),
            ("bf16", 128, False, 1, 16, True, 0), ("bf16", 0, False, 1, 64, False, 8192), ("bf16", 0, False, 1, 16,
                                                                                            False, -1)]:
        args = {name: "i32" for name in kernel.arg_names if name.startswith("stride")}
        args |= {name: f"*{dtype}" for name in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr", "sinks_ptr")}
        args |= {"part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32"}
        args |= {"block_table_ptr": "*i32", "cu_seqlens_q_ptr": "*i32", "seq_lens_ptr": "*i32", "scale": "fp32",
                 "softcap": "fp32", "num_seqs": "i32"}
        # (chunk -1: latent attention's shape, a group of 16 heads over 512 + 64-value latents padded to 1024)
        group, head_dim, head_dim_p = (16, 576, 1024) if chunk < 0 else (6, 128, 128)
        compile_for_h100(kernel, args, dict(
            GROUP=group, BLOCK_Q=rows // group, BLOCK_M=rows, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
            BLOCK_SIZE=16, TILE=32, WINDOW=window, CHUNK=max(chunk, 0), USE_SOFTCAP=softcap, USE_SINKS=sinks,
            DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", UPCAST=False, NUM_HEADS=2 * group,
            NUM_SEGMENTS=segments, CAUSAL=not softcap, FP8=False))  # (one variant both ways: an encoder's)
    merge = attention._merge_segments_kernel
    for sinks in (False, True):
        compile_for_h100(merge, {"out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32",
                                  "part_l_ptr": "*fp32", "cu_seqlens_q_ptr": "*i32", "sinks_ptr": "*bf16",
                                  "num_seqs": "i32", "stride_ot": "i32", "stride_oh": "i32"},
                          dict(NUM_HEADS=12, NUM_SEGMENTS=16, HEAD_DIM=128, HEAD_DIM_P=128, USE_SINKS=sinks))
    # an fp8 cache (--kv-cache-dtype fp8: its bytes, decoded in the kernel) read by bf16 queries
    args = {name: "i32" for name in kernel.arg_names if name.startswith("stride")}
    args |= {name: "*bf16" for name in ("out_ptr", "q_ptr", "sinks_ptr")}
    args |= {"k_cache_ptr": "*u8", "v_cache_ptr": "*u8", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32",
             "part_l_ptr": "*fp32", "block_table_ptr": "*i32", "cu_seqlens_q_ptr": "*i32", "seq_lens_ptr": "*i32",
             "scale": "fp32", "softcap": "fp32", "num_seqs": "i32"}
    compile_for_h100(kernel, args, dict(
        GROUP=6, BLOCK_Q=16 // 6, BLOCK_M=16, HEAD_DIM=128, HEAD_DIM_P=128, BLOCK_SIZE=16, TILE=32, WINDOW=0,
        CHUNK=0, USE_SOFTCAP=False, USE_SINKS=False, DOT_PRECISION="tf32", UPCAST=False, NUM_HEADS=12,
        NUM_SEGMENTS=16, CAUSAL=True, FP8=True))
    store = kv_store._store_kv_kernel
    for cache, fp8 in (("*bf16", False), ("*u8", True)):
        args = {name: "i32" for name in store.arg_names if name.startswith("stride")}
        args |= {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache, "slot_ptr": "*i64"}
        compile_for_h100(store, args, dict(NUM_KV_HEADS=2, HEAD_DIM=128, HEADS_P=2, HEAD_DIM_P=128, BLOCK_SIZE=16,
                                           FP8=fp8))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 2, 128), (32, 8, 128), (8, 8, 64)])
def test_cuda_attention_matches_reference(dtype, heads, kv_heads, head_dim):
    from runlm.kernels.triton.attention import paged_attention
    seqs = [(1, 300), (1, 17), (40, 100), (128, 128), *[(1, n) for n in range(60, 600, 37)]]
    q, kc, vc, table, cu, lens = _step(seqs, heads, kv_heads, head_dim, dtype=dtype, device="cuda")
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for window, softcap, segments in [(None, None, 1), (64, None, 1), (None, 50.0, 1), (None, None, 16),
                                      (100, 30.0, 8)]:
        out = paged_attention(q, kc, vc, table, cu, lens, head_dim ** -0.5, window, softcap, num_segments=segments)
        exact = _sdpa_per_sequence(q, kc, vc, table, cu, lens, head_dim ** -0.5, window, softcap)
        assert (out.double() - exact).abs().max() <= tol, (window, softcap, segments)


@needs_cuda
def test_cuda_kv_store_matches_index_copy():
    from runlm.kernels.triton.kv_store import store_kv
    _check_store(store_kv, "cuda")


@needs_cuda
def test_cuda_fp8_cache():
    from runlm.kernels.triton.attention import paged_attention
    from runlm.kernels.triton.kv_store import store_kv
    _check_fp8_cache(store_kv, paged_attention, "cuda")


@needs_cuda
@pytest.mark.parametrize("max_query_len", [None, 1], ids=["one-pass", "split-kv"])
def test_cuda_backend_graph_replay(max_query_len):
    """The backend captured in a CUDA graph replays with new metadata set between replays."""
    from runlm.kernels.triton.backend import PagedAttentionBackend
    heads, kv_heads, d = 8, 2, 64
    backend = PagedAttentionBackend(1, 64, 16, kv_heads, d, torch.bfloat16, "cuda", max_num_seqs=8,
                                    max_num_tokens=8, max_blocks_per_seq=8)
    assert backend.use_triton
    g = torch.Generator(device="cuda").manual_seed(0)
    kc, vc = backend.caches[0]
    kc.copy_(torch.randn(kc.shape, generator=g, device="cuda"))
    vc.copy_(torch.randn(vc.shape, generator=g, device="cuda"))
    table = torch.arange(64, dtype=torch.int32, device="cuda").view(8, 8)
    cu = torch.arange(9, dtype=torch.int32, device="cuda")
    q = torch.randn(8, heads, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def meta(step):
        """Sequence i (table row i) decodes its token at position 10 + 11 i + step."""
        lens = torch.tensor([10 + 11 * i + step for i in range(8)], dtype=torch.int32, device="cuda")
        pos = (lens - 1).long()
        return lens, table.gather(1, (pos // 16)[:, None])[:, 0].long() * 16 + pos % 16

    lens, slots = meta(0)
    backend.set_step(table, cu, lens, slots, max_query_len=max_query_len)
    assert backend.num_segments() == (1 if max_query_len is None else 16)
    backend.forward(0, q, k, v, d ** -0.5, None, None)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(0, q, k, v, d ** -0.5, None, None)
    for step in range(1, 4):
        lens, slots = meta(step)
        backend.set_step(table, cu, lens, slots, max_query_len=max_query_len)
        graph.replay()
        torch.cuda.synchronize()
        want = reference.paged_attention_ref(q, kc, vc, table, cu, lens, d ** -0.5)
        assert (out.float() - want.float()).abs().max() <= 2e-2
        flat = backend.flat_caches()[0][0]
        assert torch.equal(flat[slots], k)
