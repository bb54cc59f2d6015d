"""A GGUF mixture of experts' layers for the native decoder (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss).

Each MoE layer's experts stay in the file: the stacked ``ffn_gate_exps`` / ``ffn_up_exps`` /
``ffn_down_exps`` tensors (or llama.cpp's merged ``ffn_gate_up_exps``) are handed to the native op as
views of the mapping, the router ``ffn_gate_inp`` as fp32 where the file keeps it so (as llama.cpp's
converter does; the torch fast path computes it in fp32 too), and Qwen2-MoE's shared expert
(``ffn_*_shexp``, gated by ``ffn_gate_inp_shexp``) as an ordinary fused linear pair. What the op computes
is runlm/models/moe.py's SparseMoeBlock (csrc/moe_impl.h says how).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from runlm.formats.gguf import GGUFFile, ggml_type
from runlm.models.config import ModelConfig
from runlm.native import kernels
from runlm.native.moe import Experts, OAIExperts

_F32 = 0  # ggml's type id of fp32
# the routers: fp32 matrices the op reads as such (the native linear layers take no fp32 weights)
ROUTERS = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight")


def why_not_native_moe(gguf: GGUFFile, cfg: ModelConfig) -> str | None:
    """Why this file's experts cannot run natively (None: they can)."""
    if not isinstance(gguf, GGUFFile):  # a safetensors directory (runlm.models.native_safetensors)
        return "a mixture of experts outside a GGUF file"
    if cfg.num_experts_per_tok < 1 or cfg.num_experts_per_tok > cfg.num_experts:
        return f"{cfg.num_experts_per_tok} experts per token of {cfg.num_experts}"
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            continue
        b = f"blk.{i}"
        merged = f"{b}.ffn_gate_up_exps.weight" in gguf.tensors
        names = [f"{b}.ffn_gate_up_exps"] if merged else [f"{b}.ffn_gate_exps", f"{b}.ffn_up_exps"]
        for name in [*names, f"{b}.ffn_down_exps", f"{b}.ffn_gate_inp"]:
            info = gguf.tensors.get(f"{name}.weight")
            if info is None:
                return f"no tensor {name}.weight"
            if not kernels.supported(ggml_type(info.qtype)) and not (name.endswith("_inp") and info.qtype == "F32"):
                return f"tensor {name}.weight of type {info.qtype}"
    return None


def _stacked(gguf: GGUFFile, name: str) -> tuple[np.ndarray, int]:
    """(the raw bytes of a stacked expert tensor as a uint8 view of the mapping, its ggml type)."""
    return gguf.raw(name), ggml_type(gguf.tensors[name].qtype)


def _router(gguf: GGUFFile, name: str) -> tuple[np.ndarray, int]:
    """The router [experts, hidden]: fp32 where stored so, else its raw blocks."""
    qtype = ggml_type(gguf.tensors[name].qtype)
    if qtype == _F32:
        return np.ascontiguousarray(gguf.load_array(name), dtype=np.float32), _F32
    return gguf.raw(name), qtype


def layer_experts(gguf: GGUFFile, cfg: ModelConfig, i: int,
                  linear: Callable[[list[str], int], kernels.LinearWeights]) -> Experts:
    """Layer i's experts. ``linear(names, cols)`` builds a fused LinearWeights (the shared expert's)."""
    b, h = f"blk.{i}", cfg.hidden_size
    merged = f"{b}.ffn_gate_up_exps.weight" in gguf.tensors
    gate = _stacked(gguf, f"{b}.ffn_gate_up_exps.weight" if merged else f"{b}.ffn_gate_exps.weight")
    up = None if merged else _stacked(gguf, f"{b}.ffn_up_exps.weight")
    router, router_type = _router(gguf, f"{b}.ffn_gate_inp.weight")
    shared, shared_gate = None, None
    if f"{b}.ffn_up_shexp.weight" in gguf.tensors:
        shared = (linear([f"{b}.ffn_gate_shexp", f"{b}.ffn_up_shexp"], h),
                  linear([f"{b}.ffn_down_shexp"], cfg.shared_expert_intermediate_size))
        if f"{b}.ffn_gate_inp_shexp.weight" in gguf.tensors:
            shared_gate = np.ascontiguousarray(gguf.load_array(f"{b}.ffn_gate_inp_shexp.weight").reshape(-1),
                                               dtype=np.float32)
    return Experts(cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, h, cfg.expert_size, router,
                   router_type, gate, up, _stacked(gguf, f"{b}.ffn_down_exps.weight"), act=cfg.hidden_act,
                   shared=shared, shared_gate=shared_gate, oai=_oai(gguf, cfg, b))


def _oai(gguf: GGUFFile, cfg: ModelConfig, b: str) -> OAIExperts | None:
    """gpt-oss's biases (the router's, each expert's gate/up and down) and its clamped SwiGLU; None for others."""
    if cfg.swiglu_limit is None:
        return None

    def flat(name: str) -> np.ndarray | None:
        return np.ascontiguousarray(gguf.load_array(name).reshape(-1), dtype=np.float32) \
            if name in gguf.tensors else None

    e, i = cfg.num_experts, cfg.expert_size
    gate, up = (gguf.load_array(f"{b}.{n}.bias").reshape(e, i) for n in ("ffn_gate_exps", "ffn_up_exps")) \
        if f"{b}.ffn_gate_exps.bias" in gguf.tensors else (None, None)
    gate_up = None if gate is None else np.ascontiguousarray(np.concatenate([gate, up], axis=1).reshape(-1),
                                                             dtype=np.float32)
    return OAIExperts(flat(f"{b}.ffn_gate_inp.bias"), gate_up, flat(f"{b}.ffn_down_exps.bias"), cfg.swiglu_limit)
