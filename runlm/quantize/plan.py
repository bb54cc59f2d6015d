"""Which block type each tensor gets: llama.cpp's choices (src/llama-quant.cpp) for the file types runlm writes.

A file type (``Q4_K_M``...) names a default block type; the ``_S``/``_M`` mixes give some tensors more bits: the
output (and tied token embeddings) Q6_K, half of the value projections and ``ffn_down`` layers Q6_K in the ``_M``
mixes (llama.cpp's ``use_more_bits``: the first and last eighth and every third between), and so on. Tensors are
visited in llama.cpp's order (by layer, then name) because its layer counters follow that order. Only 2-D-or-more
weights are quantized: norms, biases, routers and position tables keep their type. A row length a block does not
divide falls back as llama.cpp falls back (Q4_K -> Q5_0, Q6_K -> Q8_0, ... then F16).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGMLQuantizationType as T

# name -> (llama_ftype, the default block type)
FILE_TYPES: dict[str, tuple[int, T]] = {
    "F32": (0, T.F32), "F16": (1, T.F16), "BF16": (32, T.BF16), "Q8_0": (7, T.Q8_0), "Q4_0": (2, T.Q4_0),
    "Q4_1": (3, T.Q4_1), "Q5_0": (8, T.Q5_0), "Q5_1": (9, T.Q5_1), "Q4_K_S": (14, T.Q4_K), "Q4_K_M": (15, T.Q4_K),
    "Q5_K_S": (16, T.Q5_K), "Q5_K_M": (17, T.Q5_K), "Q6_K": (18, T.Q6_K),
}
ALIASES = {"Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0, T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0}
_BLOCK = {T.F32: 1, T.F16: 1, T.BF16: 1, T.Q4_0: 32, T.Q4_1: 32, T.Q5_0: 32, T.Q5_1: 32, T.Q8_0: 32,
          T.Q4_K: 256, T.Q5_K: 256, T.Q6_K: 256, T.Q2_K: 256, T.Q3_K: 256}
# substrings of weights never quantized (llama.cpp's tensor_allows_quantization)
_KEEP = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
         "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight", "time_mix_first",
         "time_mix_w0", "time_mix_w1", "time_mix_w2", "time_mix_v0", "time_mix_v1", "time_mix_v2", "time_mix_a0",
         "time_mix_a1", "time_mix_a2", "time_mix_g1", "time_mix_g2", "time_mix_decay_w1", "time_mix_decay_w2",
         "time_mix_lerp_fused", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_",
         ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd")
_KEEP_EXACT = ("position_embd.weight", "token_types.weight")
_LAYER = re.compile(r"blk\.(\d+)\.")


def file_type(name: str) -> tuple[str, int, T]:
    """'q4_k_m' -> ('Q4_K_M', llama_ftype, default type); a ValueError lists the names."""
    key = ALIASES.get(name.upper(), name.upper())
    if key not in FILE_TYPES:
        raise ValueError(f"unknown quantization type {name!r} (one of: {', '.join(FILE_TYPES)})")
    return key, *FILE_TYPES[key]


def layer_of(name: str) -> int:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def llama_order(names: list[str]) -> list[str]:
    """llama.cpp's tensor order (its weight_name_comparer): by layer (non-layer tensors first), then name."""
    return sorted(names, key=lambda n: (layer_of(n), n))


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"), ("attn_v.weight", "attn_v"),
                      ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                      ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                      ("ffn_down", "ffn_down")):
        if part in name:
            return cat
    return "other"


def quantizable(name: str, n_dims: int) -> bool:
    return n_dims >= 2 and name.endswith("weight") and not any(k in name for k in _KEEP) and name not in _KEEP_EXACT


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass(slots=True)
class ModelFacts:
    arch: str
    n_layer: int
    n_expert: int = 0
    is_70b: bool = False


def plan_types(tensors: list[tuple[str, tuple[int, ...], T]], ftype_name: str, facts: ModelFacts,
               has_imatrix: bool = False) -> dict[str, T]:
    """{tensor name: the block type it is written in}. ``tensors``: (name, shape in ggml order (ne0 first), type),
    in llama_order."""
    key, _, default = file_type(ftype_name)
    cats = {name: _category(name) for name, _, _ in tensors}
    n_wv = sum(c in ("attn_v", "attn_qkv", "attn_kv_b") for c in cats.values())
    tied = "output" not in cats.values()
    quantized = default not in FLOAT_TYPES
    i_wv = i_down = 0
    out: dict[str, T] = {}
    for name, shape, current in tensors:
        if not quantizable(name, len(shape)):
            out[name] = current
            continue
        new = default
        if quantized:
            cat = cats[name]
            if cat == "output" or (tied and cat == "token_embd"):
                if facts.arch == "falcon" or shape[0] % _BLOCK[new]:
                    new = T.Q8_0
                elif new != T.Q8_0:
                    new = T.Q6_K
            elif cat in ("attn_v", "attn_qkv", "attn_kv_b"):  # llama.cpp's category_is_attn_v
                if key in ("Q4_K_M", "Q5_K_M") and _more_bits(i_wv, n_wv):
                    new = T.Q6_K
                elif key == "Q4_K_S" and i_wv < 4:
                    new = T.Q5_K
                if facts.is_70b and new in (T.Q3_K, T.Q4_K):
                    new = T.Q5_K
                if facts.n_expert == 8:
                    new = T.Q8_0
                i_wv += 1
            elif cat == "attn_k" and facts.n_expert == 8:
                new = T.Q8_0
            elif cat == "ffn_down":
                i_layer, n_layer = (layer_of(name), facts.n_layer) if facts.n_expert > 1 else (i_down, facts.n_layer)
                if key == "Q4_K_M":
                    if facts.arch == "falcon":
                        new = T.Q6_K if i_layer < n_layer // 16 else T.Q5_K if _more_bits(i_layer, n_layer) \
                            else T.Q4_K
                    elif _more_bits(i_layer, n_layer):
                        new = T.Q6_K
                elif key == "Q5_K_M" and _more_bits(i_layer, n_layer):
                    new = T.Q6_K
                elif key == "Q4_K_S" and facts.arch != "falcon" and i_layer < n_layer // 8:
                    new = T.Q5_K
                elif key in ("Q4_0", "Q5_0") and has_imatrix and i_layer < n_layer // 8:
                    new = T.Q4_1 if key == "Q4_0" else T.Q5_1
                i_down += 1
            elif cat == "attn_output":
                if facts.arch != "falcon" and facts.n_expert == 8 and key in ("Q4_K_S", "Q4_K_M"):
                    new = T.Q5_K
            new = _fallback(new, shape[0])
        out[name] = new
    return out


def _fallback(qtype: T, ncols: int) -> T:
    """llama.cpp's tensor_type_fallback: a row a block does not divide gets a type whose block does, else F16."""
    if ncols % _BLOCK[qtype] == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, qtype)
    return qtype if ncols % _BLOCK[qtype] == 0 else T.F16
