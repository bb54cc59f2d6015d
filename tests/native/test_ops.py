"""runlm.native.kernels: every C-ABI op gives the torch extension op's bits, on random data and on a real
GGUF weight, whatever the thread count and whatever else shares the batch."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from runlm.kernels import attention, fused, ggml
from runlm.native import kernels as nk

pytestmark = pytest.mark.skipif(not (nk.available() and ggml.available() and fused.available()),
                                reason="the native kernels or the torch extensions are unavailable here")

K = 512  # a whole number of every block size (32 and 256)
TYPES = [T.F16, T.BF16, T.Q8_0, T.Q5_0, T.Q5_1, T.Q4_0, T.Q4_1, T.IQ4_NL, T.IQ4_XS, T.Q6_K, T.Q5_K, T.Q4_K,
         T.Q3_K, T.Q2_K]


def _randn(*shape: int, seed: int) -> np.ndarray:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).numpy()


@pytest.fixture
def threads() -> Iterator[None]:
    before = nk.get_threads()
    yield
    nk.set_threads(before)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_is_the_extensions(qtype: T, threads: None) -> None:
    raw = ggml.quantize(torch.from_numpy(_randn(69, K, seed=0)), qtype)  # 69 rows: a partial panel of 8
    bias = _randn(69, seed=4)
    x = _randn(40, K, seed=1)  # a chunk of 32 rows and a rest
    ref = ggml.linear(torch.from_numpy(x), [raw], [qtype], torch.from_numpy(bias)).numpy()
    w = nk.LinearWeights([raw.numpy()], [qtype], K, bias)
    assert (w.rows, w.cols) == (69, K)
    out = nk.linear(x, w, np.empty((40, 69), np.float32))
    assert np.array_equal(out, ref)
    nk.set_threads(1)
    assert np.array_equal(nk.linear(x, w, np.empty_like(out)), ref)
    for m in (1, 7, 33):  # a row's result never depends on the batch
        assert np.array_equal(nk.linear(x[:m], w, np.empty((m, 69), np.float32)), ref[:m])
    assert np.array_equal(nk.linear(x[11:12], w, np.empty((1, 69), np.float32)), ref[11:12])


@pytest.mark.parametrize("n_threads", [2, 3, 5])
def test_pieces_that_cut_through_segments_give_the_same_bits(n_threads: int, threads: None) -> None:
    """Threads take a linear layer's work in pieces from a shared counter (parallel_pieces): a piece may end inside
    one segment (q of a fused qkv) and the next begin there, and any thread may take any piece. Every output is
    still the single-thread bits, for a decode row and for a prefill chunk."""
    types = [T.Q4_K, T.Q6_K, T.Q8_0]
    raws = [ggml.quantize(torch.from_numpy(_randn(rows, K, seed=i)), t) for i, (rows, t) in
            enumerate(zip((200, 36, 44), types))]
    w = nk.LinearWeights([r.numpy() for r in raws], types, K)
    for m in (1, 9):
        x = _randn(m, K, seed=7)
        nk.set_threads(1)
        ref = nk.linear(x, w, np.empty((m, 280), np.float32))
        nk.set_threads(n_threads)
        for _ in range(5):
            assert np.array_equal(nk.linear(x, w, np.empty_like(ref)), ref)


def test_calls_from_many_threads_and_from_a_forked_child_give_the_same_bits(threads: None) -> None:
    """The library's own workers: calls racing from Python threads (one runs split, the others on their own
    thread), and a forked child (which has none of the parent's workers) all compute the same outputs."""
    import os
    import threading
    import time

    raw = ggml.quantize(torch.from_numpy(_randn(1024, K, seed=0)), T.Q4_K)
    w = nk.LinearWeights([raw.numpy()], [T.Q4_K], K)
    x = _randn(3, K, seed=1)
    nk.set_threads(1)
    ref = nk.linear(x, w, np.empty((3, 1024), np.float32))
    nk.set_threads(4)  # more workers than this machine may have cores: each must still take its chunk
    assert np.array_equal(nk.linear(x, w, np.empty_like(ref)), ref)
    bad: list[int] = []

    def hammer(i: int) -> None:
        out = np.empty_like(ref)
        for _ in range(30):
            if not np.array_equal(nk.linear(x, w, out), ref):
                bad.append(i)

    racers = [threading.Thread(target=hammer, args=(i,)) for i in range(6)]
    for t in racers:
        t.start()
    for t in racers:
        t.join(timeout=120)
    assert not bad and not any(t.is_alive() for t in racers)
    pid = os.fork()
    if pid == 0:  # the child: a call must neither hang on the parent's workers nor differ
        os._exit(0 if np.array_equal(nk.linear(x, w, np.empty_like(ref)), ref) else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0


def test_segments_of_mixed_types_concatenate_their_outputs() -> None:
    weight = torch.from_numpy(_randn(72, K, seed=0))
    parts = [(weight[:32], T.Q4_K), (weight[32:48], T.Q6_K), (weight[48:], T.Q8_0)]
    raws = [ggml.quantize(w, t) for w, t in parts]
    x, bias = _randn(3, K, seed=3), _randn(72, seed=5)
    ref = ggml.linear(torch.from_numpy(x), raws, [t for _, t in parts], torch.from_numpy(bias)).numpy()
    w = nk.LinearWeights([r.numpy() for r in raws], [t for _, t in parts], K, bias)
    assert np.array_equal(nk.linear(x, w, np.empty((3, 72), np.float32)), ref)


def test_bad_inputs_are_refused_with_a_reason() -> None:
    raw = ggml.quantize(torch.from_numpy(_randn(8, K, seed=0)), T.Q4_K).numpy()
    with pytest.raises(ValueError, match="needs"):
        nk.LinearWeights([raw], [T.Q4_K], 2 * K)
    w = nk.LinearWeights([raw], [T.Q4_K], K)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        nk.linear(_randn(2, K, seed=1).astype(np.float64), w, np.empty((2, 8), np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        nk.linear(_randn(2, K, seed=1), w, np.empty((2, 9), np.float32))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        nk.embedding(np.array([8]), raw, T.Q4_K, K, np.empty((1, K), np.float32))
    w.close()
    with pytest.raises(ValueError, match="closed"):
        nk.linear(_randn(2, K, seed=1), w, np.empty((2, 8), np.float32))


def test_embedding_and_dequantize_are_the_extensions() -> None:
    raw = ggml.quantize(torch.from_numpy(_randn(72, K, seed=0)), T.Q6_K)
    ids = np.array([5, 0, 71, 5], dtype=np.int64)
    out = nk.embedding(ids, raw.numpy(), T.Q6_K, K, np.empty((4, K), np.float32))
    assert np.array_equal(out, ggml.embedding(torch.from_numpy(ids), raw, T.Q6_K, K).numpy())
    assert np.array_equal(nk.dequantize(raw.numpy(), T.Q6_K, K), ggml.dequantize(raw, T.Q6_K, K).numpy())
    assert nk.row_bytes(T.Q6_K, K) == ggml.row_bytes(T.Q6_K, K) and nk.block_size(T.Q4_K) == 256
    assert nk.supported(T.Q4_K) and not nk.supported(10_000)
    assert "AVX2" in nk.cpu_features()


def test_real_gguf_weights_give_the_extensions_bits(smollm2_gguf: Path) -> None:
    reader = GGUFReader(smollm2_gguf)
    tensors = {t.name: t for t in reader.tensors}
    x = _randn(5, 576, seed=7)
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        raw, cols = np.array(t.data), int(t.shape[0])  # a writable copy: torch warns on the read-only map
        xs = x if cols == 576 else _randn(5, cols, seed=8)
        w = nk.LinearWeights([raw], [int(t.tensor_type)], cols)
        ref = ggml.linear(torch.from_numpy(xs), [torch.from_numpy(raw)], [int(t.tensor_type)]).numpy()
        assert np.array_equal(nk.linear(xs, w, np.empty((5, w.rows), np.float32)), ref), name
    emb = tensors["token_embd.weight"]
    table, ids = np.array(emb.data), np.array([1, 200, 49151], dtype=np.int64)
    ref = ggml.embedding(torch.from_numpy(ids), torch.from_numpy(table), int(emb.tensor_type), 576).numpy()
    assert np.array_equal(nk.embedding(ids, table, int(emb.tensor_type), 576, np.empty((3, 576), np.float32)), ref)


def test_norms_and_gated_activations_are_the_extensions(threads: None) -> None:
    ops = fused.ops()
    x, r, w = _randn(70, 576, seed=0), _randn(70, 576, seed=1), _randn(576, seed=2)
    ref = ops.rms_norm(torch.from_numpy(x), torch.from_numpy(w), 1e-5).numpy()
    for n in (1, 2):
        nk.set_threads(n)
        assert np.array_equal(nk.rms_norm(x, w, 1e-5, np.empty_like(x)), ref)
    residual_ref = torch.from_numpy(r.copy())
    ref = ops.add_rms_norm(torch.from_numpy(x), residual_ref, torch.from_numpy(w), 1e-6).numpy()
    residual = r.copy()
    assert np.array_equal(nk.add_rms_norm(x, residual, w, 1e-6, np.empty_like(x)), ref)
    assert np.array_equal(residual, residual_ref.numpy())
    gate_up = _randn(33, 2 * 1536, seed=3) * 4
    out = np.empty((33, 1536), np.float32)
    assert np.array_equal(nk.silu_mul(gate_up, out), ops.silu_mul(torch.from_numpy(gate_up)).numpy())
    assert np.array_equal(nk.gelu_tanh_mul(gate_up, out), ops.gelu_tanh_mul(torch.from_numpy(gate_up)).numpy())


@pytest.mark.parametrize("interleaved,qk_norm", [(False, False), (True, True)])
def test_qkv_rope_store_is_the_extensions(interleaved: bool, qk_norm: bool) -> None:
    heads, kv_heads, d, t, slots = 6, 2, 64, 9, 40
    qkv, cos, sin = _randn(t, (heads + 2 * kv_heads) * d, seed=0), _randn(100, d, seed=1), _randn(100, d, seed=2)
    positions = np.array([0, 1, 2, 3, 4, 50, 51, 99, 7], dtype=np.int64)
    slot_mapping = np.array([3, 9, 1, 0, 39, 20, 21, 22, 5], dtype=np.int64)
    qn, kn = (_randn(d, seed=3), _randn(d, seed=4)) if qk_norm else (None, None)
    kc, vc = np.zeros((slots, kv_heads, d), np.float32), np.zeros((slots, kv_heads, d), np.float32)
    kc_ref, vc_ref = torch.zeros(slots, kv_heads, d), torch.zeros(slots, kv_heads, d)
    ref = fused.ops().qkv_rope_store(torch.from_numpy(qkv), torch.from_numpy(positions), torch.from_numpy(cos),
                                     torch.from_numpy(sin), kc_ref, vc_ref, torch.from_numpy(slot_mapping), heads,
                                     kv_heads, d, interleaved, None if qn is None else torch.from_numpy(qn),
                                     None if kn is None else torch.from_numpy(kn), 1e-6).numpy()
    q = nk.qkv_rope_store(qkv, positions, cos, sin, kc, vc, slot_mapping, heads, kv_heads, d, interleaved, qn, kn,
                          1e-6, np.empty((t, heads, d), np.float32))
    assert np.array_equal(q, ref) and np.array_equal(kc, kc_ref.numpy()) and np.array_equal(vc, vc_ref.numpy())
    with pytest.raises(ValueError, match="past the rope table"):
        nk.qkv_rope_store(qkv[:1], np.array([100]), cos, sin, kc, vc, slot_mapping[:1], heads, kv_heads, d,
                          interleaved, qn, kn, 1e-6, np.empty((1, heads, d), np.float32))


@pytest.mark.parametrize("heads,kv_heads,d,window,softcap", [(9, 3, 64, None, None), (4, 4, 20, 5, None),
                                                              (8, 2, 32, None, 30.0)])
def test_paged_attention_is_the_extensions(heads: int, kv_heads: int, d: int, window: int | None,
                                           softcap: float | None, threads: None) -> None:
    kc, vc = _randn(512, kv_heads, d, seed=0), _randn(512, kv_heads, d, seed=1)
    query_lens, context_lens = [1, 7, 1, 33, 1], [1, 40, 90, 33, 3]
    g = torch.Generator().manual_seed(2)
    slots = torch.cat([torch.randperm(512, generator=g)[:c] for c in context_lens])
    q = _randn(sum(query_lens), heads, d, seed=3)
    ref = attention.paged_attention(torch.from_numpy(q), torch.from_numpy(kc), torch.from_numpy(vc), slots,
                                    query_lens, context_lens, d ** -0.5, window, softcap).numpy()
    ql, cl = np.array(query_lens, dtype=np.int64), np.array(context_lens, dtype=np.int64)
    for n in (1, 2):
        nk.set_threads(n)
        out = np.empty_like(q)
        assert nk.paged_attention(q, kc, vc, slots.numpy(), ql, cl, d ** -0.5, window, softcap, out)
        assert np.array_equal(out, ref)
    # a row's result never depends on the batch: the fourth sequence alone
    s0, r0 = sum(context_lens[:3]), sum(query_lens[:3])
    alone = np.empty((33, heads, d), np.float32)
    assert nk.paged_attention(q[r0:r0 + 33], kc, vc, slots.numpy()[s0:s0 + 33], ql[3:4], cl[3:4], d ** -0.5, window,
                              softcap, alone)
    assert np.array_equal(alone, ref[r0:r0 + 33])
    with pytest.raises(ValueError, match="lengths"):
        nk.paged_attention(q, kc, vc, slots.numpy(), ql, cl + 1, d ** -0.5, window, softcap, out)


def test_addresses_follow_new_arrays_that_reuse_a_freed_ones_id() -> None:
    """ptr() remembers the addresses of arrays that own their data; a new array never gets an old one's."""
    w = _randn(64, seed=0)
    for i in range(40):
        x = _randn(3, 64, seed=i)
        ref = fused.ops().rms_norm(torch.from_numpy(x), torch.from_numpy(w), 1e-6).numpy()
        assert np.array_equal(nk.rms_norm(x, w, 1e-6, np.empty_like(x)), ref)
        del x
