"""A whole decoder step in one native call (csrc/native_decoder.h): the token embedding, then per layer
exactly LlamaModel._forward_fused's ops (rms_norm; qkv linear; qkv_rope_store; paged_attention; o linear;
add_rms_norm; gate_up linear; act·mul; down linear; add_rms_norm into the next layer's input norm or the
final norm), returning the final-normed hidden states, the same bits as the per-op path. Python runs once
per step; the scratch buffers live in the native decoder and are reused across steps. A vision-language
model's image rows go in as embeddings written over their tokens' (``forward(..., embeds=(rows, values))``,
a separate entry point: a text-only step calls exactly what it called before). A layer's ``family`` settings
(partial rotary, whole-projection q/k norms, its KV group) and a step's ``groups`` (the slots of the sliding-window
layers' own cache) are what Phi-3, OLMo2/OLMoE and Gemma 2/3 add."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from runlm.kv_size import q8_row_bytes
from runlm.native.library import F16, F32, I64, U8, Handle, arr, check_shape, lib, ok, optional_f32, vector

if TYPE_CHECKING:
    from runlm.native.linear_weights import LinearWeights
    from runlm.native.moe import Experts

_ACTS = {"silu": 0, "gelu_tanh": 1}


@dataclass(frozen=True)
class LayerFamily:
    """A layer's settings beyond the Llama layer's. rotary: the features of each head RoPE rotates (the tables'
    width; 0: all); qk_norm_whole: q_norm [H D] and k_norm [KVH D] normalize the whole projection (OLMo2, OLMoE);
    group: the KV group holding the layer's K/V (0: the step's own slots; g: row g - 1 of forward's groups)."""
    rotary: int = 0
    qk_norm_whole: bool = False
    group: int = 0


@dataclass
class DecoderLayer:
    """One layer's weights and settings. post_norm is the MLP input's norm (Llama's
    post_attention_layernorm; Gemma's pre_feedforward_layernorm, whose sandwich norms are
    attn_out_norm and mlp_out_norm). window None: full attention; softcap None: none. A layer with
    ``moe`` (a mixture of experts) has no gate_up / down: the experts are its MLP."""
    qkv: LinearWeights
    o: LinearWeights
    gate_up: LinearWeights | None
    down: LinearWeights | None
    input_norm: np.ndarray
    post_norm: np.ndarray
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    cos: np.ndarray
    sin: np.ndarray
    scale: float
    window: int | None
    softcap: float | None
    act: str = "silu"
    attn_out_norm: np.ndarray | None = None
    mlp_out_norm: np.ndarray | None = None
    moe: Experts | None = None
    family: LayerFamily | None = None
    sinks: np.ndarray | None = None  # [heads]: each head's attention sink logit (gpt-oss)


class Decoder(Handle):
    """The model's decoder stack as one native object. Holds every array it was given alive; the KV
    caches are set (and set again after they are reallocated) with ``set_kv_caches``."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, interleaved: bool,
                 embed_table: np.ndarray, embed_qtype: int, final_norm: np.ndarray, layers: list[DecoderLayer],
                 embed_scale: float = 1.0) -> None:
        native = lib()
        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        table = arr(embed_table, U8, "embed_table", 2)
        handle = native.runlm_decoder_new(hidden, heads, kv_heads, head_dim, eps, int(interleaved), table,
                                          embed_table.shape[0], embed_table.shape[1], int(embed_qtype), embed_scale,
                                          vector(final_norm, "final_norm", hidden), len(layers))
        super().__init__(handle, "runlm_decoder_free", "decoder")
        self._keep: list[object] = [embed_table, final_norm, layers]
        self._caches: list[tuple[np.ndarray, np.ndarray]] = []
        self.layers = layers
        for i, layer in enumerate(layers):
            if layer.act not in _ACTS:
                raise ValueError(f"layer {i}: act must be one of {sorted(_ACTS)}, not {layer.act!r}")
            fam = layer.family or LayerFamily()
            rope = arr(layer.cos, F32, "cos", 2)
            check_shape("cos", layer.cos.shape, (layer.cos.shape[0], fam.rotary or head_dim))
            q_width, k_width = (heads * head_dim, kv_heads * head_dim) if fam.qk_norm_whole else (head_dim, head_dim)
            check_shape("sin", layer.sin.shape, layer.cos.shape)
            ok(native.runlm_decoder_set_layer(
                handle, i, layer.qkv.handle, layer.o.handle, layer.gate_up.handle if layer.gate_up else None,
                layer.down.handle if layer.down else None,
                vector(layer.input_norm, "input_norm", hidden),
                vector(layer.post_norm, "post_norm", hidden),
                optional_f32(layer.q_norm, "q_norm", q_width), optional_f32(layer.k_norm, "k_norm", k_width),
                optional_f32(layer.attn_out_norm, "attn_out_norm", hidden),
                optional_f32(layer.mlp_out_norm, "mlp_out_norm", hidden), rope, arr(layer.sin, F32, "sin", 2),
                layer.cos.shape[0], layer.scale, layer.window or 0, layer.softcap or 0.0, _ACTS[layer.act]))
            if layer.moe is not None:
                ok(native.runlm_decoder_set_layer_moe(handle, i, layer.moe.handle))
            if layer.sinks is not None:
                ok(native.runlm_decoder_set_layer_sinks(handle, i, vector(layer.sinks, "sinks", heads)))
            if layer.family is not None:
                ok(native.runlm_decoder_set_layer_family(handle, i, fam.rotary, int(fam.qk_norm_whole), fam.group))
        ok(native.runlm_decoder_check(handle))  # every layer's shapes against the decoder's

    def set_kv_caches(self, caches: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Each layer's (k, v) cache, fp32 or fp16 [slots, kv_heads, head_dim], or uint8 [slots, kv_heads,
        head_dim / 32 * 34] for q8_0 blocks (runlm.native.kv_cache); kept alive until replaced."""
        if len(caches) != len(self.layers):
            raise ValueError(f"{len(caches)} caches for {len(self.layers)} layers")
        native = lib()
        for i, (k, v) in enumerate(caches):
            dtype = k.dtype if k.dtype in (U8, F16) else F32  # (anything else is refused by arr, as fp32's)
            width = q8_row_bytes(self.head_dim) if dtype == U8 else self.head_dim
            kp, vp = arr(k, dtype, f"k_cache {i}", 3), arr(v, dtype, f"v_cache {i}", 3)
            check_shape(f"k_cache {i}", k.shape, (k.shape[0], self.kv_heads, width))
            check_shape(f"v_cache {i}", v.shape, k.shape)
            if dtype == F32:
                ok(native.runlm_decoder_set_cache(self.handle, i, kp, vp, k.shape[0]))
            else:
                ok(native.runlm_decoder_set_cache_packed(self.handle, i, kp, vp, k.shape[0], int(dtype == F16)))
        self._caches = list(caches)

    def set_layer_groups(self, groups: list[int]) -> None:
        """Each layer's KV group (0: the step's own slots; g: row g - 1 of forward's ``groups``), as the engine's
        HybridBlockManager holds them (Gemma's sliding-window layers in a cache of their own)."""
        if len(groups) != len(self.layers):
            raise ValueError(f"{len(groups)} KV groups for {len(self.layers)} layers")
        for i, (layer, g) in enumerate(zip(self.layers, groups)):
            fam = layer.family or LayerFamily()
            ok(lib().runlm_decoder_set_layer_family(self.handle, i, fam.rotary, int(fam.qk_norm_whole), int(g)))

    def forward(self, ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, query_lens: np.ndarray,
                context_lens: np.ndarray, flat_slots: np.ndarray, out: np.ndarray,
                embeds: tuple[np.ndarray, np.ndarray] | None = None,
                groups: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """out [T, hidden]: the final-normed hidden states of tokens ``ids`` (int64 [T]) at ``positions``,
        their K/V written to ``slot_mapping``; sequence b's rows are its last query_lens[b] of
        context_lens[b] positions, whose slots are flat_slots[sum(context_lens[:b]) : ...].

        ``embeds``: (rows int64 [N], values float32 [N, hidden]): these rows take these input embeddings
        instead of their token's (after the embedding scale), a vision-language model's image rows.

        ``groups``: (slot maps int64 [G, T], context slots int64 [G, len(flat_slots)]) of the KV groups after the
        first, for layers whose ``family.group`` is 1..G."""
        if not self._caches:
            raise ValueError("set_kv_caches first")
        t = ids.shape[0] if ids.ndim == 1 else -1
        ip, pp = arr(ids, I64, "ids", 1), arr(positions, I64, "positions", 1)
        sp, fp = arr(slot_mapping, I64, "slot_mapping", 1), arr(flat_slots, I64, "flat_slots", 1)
        qlp, clp = arr(query_lens, I64, "query_lens", 1), arr(context_lens, I64, "context_lens", 1)
        op = arr(out, F32, "out", 2)
        if positions.shape != ids.shape or slot_mapping.shape != ids.shape or context_lens.shape != query_lens.shape:
            raise ValueError("one position and one slot per id, one context length per query length")
        check_shape("out", out.shape, (t, self.hidden))
        if groups is not None:
            self._forward_groups(ip, pp, sp, t, qlp, clp, query_lens.shape[0], fp, flat_slots.shape[0], op, embeds,
                                 groups)
            return out
        if embeds is not None and embeds[0].shape[0]:
            rows, values = embeds
            rp, vp = arr(rows, I64, "embed rows", 1), arr(values, F32, "embed values", 2)
            check_shape("embed values", values.shape, (rows.shape[0], self.hidden))
            ok(lib().runlm_decoder_forward_embeds(self.handle, ip, pp, sp, t, qlp, clp, query_lens.shape[0], fp,
                                                  flat_slots.shape[0], op, rp, vp, rows.shape[0]))
            return out
        ok(lib().runlm_decoder_forward(self.handle, ip, pp, sp, t, qlp, clp, query_lens.shape[0], fp,
                                       flat_slots.shape[0], op))
        return out

    def _forward_groups(self, ip: int, pp: int, sp: int, t: int, qlp: int, clp: int, batch: int, fp: int, n_flat: int,
                        op: int, embeds: tuple[np.ndarray, np.ndarray] | None,
                        groups: tuple[np.ndarray, np.ndarray]) -> None:
        slot_maps, flat = groups
        g = slot_maps.shape[0] if slot_maps.ndim == 2 else -1
        gsp, gfp = arr(slot_maps, I64, "group slot maps", 2), arr(flat, I64, "group context slots", 2)
        check_shape("group slot maps", slot_maps.shape, (g, t))
        check_shape("group context slots", flat.shape, (g, n_flat))
        rp = vp = None
        n = 0
        if embeds is not None and embeds[0].shape[0]:
            rows, values = embeds
            rp, vp, n = arr(rows, I64, "embed rows", 1), arr(values, F32, "embed values", 2), rows.shape[0]
            check_shape("embed values", values.shape, (n, self.hidden))
        ok(lib().runlm_decoder_forward_groups(self.handle, ip, pp, sp, t, qlp, clp, batch, fp, n_flat, op, rp, vp, n,
                                              g, gsp, gfp))
