"""runlm.native.kernels.Decoder: a whole decoder step in one native call gives LlamaModel._forward_fused's
hidden states and KV cache contents bit for bit, over a prefill chunk, a decode step and a mixed batch."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from runlm.kernels import fused, ggml
from runlm.models.attention import ForwardContext, forward_context
from runlm.models.linear import Linear
from runlm.models.llama import MLP, LlamaForCausalLM
from runlm.models.load import load_decoder
from runlm.native import kernels as nk

pytestmark = pytest.mark.skipif(not (nk.available() and ggml.available() and fused.available()),
                                reason="the native kernels or the torch extensions are unavailable here")

SLOTS = 64


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().contiguous().numpy()


def _weights(linear: Linear) -> nk.LinearWeights:
    raws = [s.raw.numpy() for s in linear.ggml]
    return nk.LinearWeights(raws, [s.qtype for s in linear.ggml], linear.ggml[0].cols, _np(linear.bias))


def decoder_of(model: LlamaForCausalLM) -> nk.Decoder:
    """The native decoder over a fast-mode model's own weights (views of the GGUF file, no copies)."""
    inner, layers = model.model, []
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(mlp, MLP)
        sandwich = hasattr(layer, "pre_feedforward_layernorm")
        attn.rope.ensure_positions(SLOTS)
        layers.append(nk.DecoderLayer(
            qkv=_weights(attn.qkv_proj), o=_weights(attn.o_proj), gate_up=_weights(mlp.gate_up_proj),
            down=_weights(mlp.down_proj), input_norm=_np(layer.input_layernorm.weight),
            post_norm=_np((layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm).weight),
            q_norm=_np(attn.q_norm.weight) if attn.qk_norm else None,
            k_norm=_np(attn.k_norm.weight) if attn.qk_norm else None,
            cos=_np(attn.rope.cos), sin=_np(attn.rope.sin), scale=attn.scale, window=attn.window,
            softcap=attn.softcap, act="silu" if mlp.act is torch.nn.functional.silu else "gelu_tanh",
            attn_out_norm=_np(layer.post_attention_layernorm.weight) if sandwich else None,
            mlp_out_norm=_np(layer.post_feedforward_layernorm.weight) if sandwich else None))
    first = inner.layers[0].self_attn
    table = inner.embed_tokens.ggml
    return nk.Decoder(model.config.hidden_size, first.heads, first.kv_heads, first.head_dim,
                      inner.layers[0].input_layernorm.eps, first.rope.interleaved, table.raw.numpy(), table.qtype,
                      _np(inner.norm.weight), layers, embed_scale=float(getattr(inner, "embed_scale", 1.0)))


class Step:
    """One step's inputs for both paths: sequences (token ids, first position, slots of every position)."""

    def __init__(self, seqs: list[tuple[list[int], int, list[int]]]) -> None:
        self.ids = np.array([i for ids, _, _ in seqs for i in ids], dtype=np.int64)
        self.positions = np.array([p0 + j for ids, p0, _ in seqs for j in range(len(ids))], dtype=np.int64)
        self.slot_mapping = np.array([s for ids, p0, sl in seqs for s in sl[p0:p0 + len(ids)]], dtype=np.int64)
        self.query_lens = np.array([len(ids) for ids, _, _ in seqs], dtype=np.int64)
        self.context_lens = np.array([p0 + len(ids) for ids, p0, _ in seqs], dtype=np.int64)
        self.flat_slots = np.array([s for ids, p0, sl in seqs for s in sl[:p0 + len(ids)]], dtype=np.int64)

    def torch(self, model: LlamaForCausalLM, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> np.ndarray:
        per_seq, s0 = [], 0
        for cl in self.context_lens:
            per_seq.append(torch.from_numpy(self.flat_slots[s0:s0 + cl]))
            s0 += cl
        ctx = ForwardContext(self.query_lens.tolist(), self.context_lens.tolist(), torch.from_numpy(self.slot_mapping),
                             per_seq, caches)
        with forward_context(ctx), torch.no_grad():
            return model(torch.from_numpy(self.ids), torch.from_numpy(self.positions)).numpy()

    def native(self, decoder: nk.Decoder) -> np.ndarray:
        out = np.empty((len(self.ids), decoder.hidden), np.float32)
        return decoder.forward(self.ids, self.positions, self.slot_mapping, self.query_lens, self.context_lens,
                               self.flat_slots, out)


def _model(name: str, smollm2_gguf: Path) -> LlamaForCausalLM:
    if name == "smollm2":
        path = smollm2_gguf
    else:
        from tests.fixtures.gguf_convert import converted_gguf

        path = converted_gguf(name, "q8_0")
    model = load_decoder(path).model
    assert model.model.fused, "the torch path under test is _forward_fused"
    return model


@pytest.mark.parametrize("name", ["smollm2", "gemma3", "gemma2"])
def test_decoder_steps_are_forward_fused_bit_for_bit(name: str, smollm2_gguf: Path) -> None:
    model = _model(name, smollm2_gguf)
    decoder = decoder_of(model)
    a = decoder.layers[0]
    kvh, d = decoder.kv_heads, decoder.head_dim
    assert a.cos.shape[1] == d
    ours = [(np.zeros((SLOTS, kvh, d), np.float32), np.zeros((SLOTS, kvh, d), np.float32)) for _ in decoder.layers]
    theirs = [(torch.zeros(SLOTS, kvh, d), torch.zeros(SLOTS, kvh, d)) for _ in decoder.layers]
    decoder.set_kv_caches(ours)
    rng = np.random.default_rng(0)
    vocab = model.model.embed_tokens.ggml.rows
    seq_a, seq_b = rng.integers(0, vocab, 12).tolist(), rng.integers(0, vocab, 5).tolist()
    slots_a, slots_b = rng.permutation(32).tolist(), (32 + rng.permutation(32)).tolist()
    steps = [Step([(seq_a[:11], 0, slots_a)]),                    # a prefill chunk
             Step([(seq_a[11:], 11, slots_a)]),                   # a decode step
             Step([(seq_a[11:], 11, slots_a), (seq_b, 0, slots_b)])]  # the same token batched with a prefill
    results = []
    for step in steps:
        mine, ref = step.native(decoder), step.torch(model, theirs)
        assert np.isfinite(mine).all() and np.array_equal(mine, ref)
        for (k, v), (kt, vt) in zip(ours, theirs):
            assert np.array_equal(k, kt.numpy()) and np.array_equal(v, vt.numpy())
        results.append(mine)
    assert np.array_equal(results[2][:1], results[1])  # a row's result never depends on the batch


def test_thread_count_does_not_change_a_step(smollm2_gguf: Path) -> None:
    model = _model("smollm2", smollm2_gguf)
    decoder = decoder_of(model)
    kvh, d = decoder.kv_heads, decoder.head_dim
    step = Step([(list(range(100, 109)), 0, list(range(9)))])
    outs = []
    before = nk.get_threads()
    try:
        for n in (1, 2):
            nk.set_threads(n)
            decoder.set_kv_caches([(np.zeros((16, kvh, d), np.float32), np.zeros((16, kvh, d), np.float32))
                                   for _ in decoder.layers])
            outs.append(step.native(decoder))
    finally:
        nk.set_threads(before)
    assert np.array_equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="outside the cache"):
        Step([([1], 0, [16])]).native(decoder)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Step([([10**7], 0, [0])]).native(decoder)
