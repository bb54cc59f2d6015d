"""A mixture of experts' MLP as the native library holds it (csrc/moe_impl.h): the router, each layer's
experts stacked in one tensor per projection as GGUF stores them (views of the file's blocks, no copy),
and Qwen2-MoE's gated shared expert. ``forward`` runs the op alone (tests); the decoder calls it in
place of a dense layer's MLP (``DecoderLayer.moe``)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runlm.native.library import F32, U8, Handle, arr, check_shape, lib, ok, optional_f32
from runlm.native.linear_weights import LinearWeights

_ACTS = {"silu": 0, "gelu_tanh": 1}


@dataclass(frozen=True)
class OAIExperts:
    """gpt-oss's experts: the router's bias [E], each expert's gate_up bias [E, 2I] (its gate's, then its up's)
    and down bias [E, hidden] (fp32, each may be None), and the clamped SwiGLU's limit."""
    router_bias: np.ndarray | None
    gate_up_bias: np.ndarray | None
    down_bias: np.ndarray | None
    swiglu_limit: float


def _stack(name: str, raw: np.ndarray, experts: int, rows: int, row_bytes: int) -> int:
    """The address of a raw uint8 [experts, rows, row_bytes] tensor (or [experts * rows, row_bytes])."""
    if raw.size != experts * rows * row_bytes:
        raise ValueError(f"{name} holds {raw.size} bytes, not {experts} experts of [{rows}, {row_bytes}]")
    return arr(raw, U8, name)


class Experts(Handle):
    """One layer's experts: ``top_k`` of ``experts`` per token from the router (fp32 [experts, hidden], or raw
    blocks of ggml type ``router_type``), their weights renormalized to sum to 1 where ``renormalize``.
    gate / up / down are (raw uint8 array, ggml type): [E, I, hidden], [E, I, hidden], [E, hidden, I];
    up None: gate is llama.cpp's merged [E, 2I, hidden], the gate's rows first. ``shared``: an always-on
    expert (gate_up [2S, hidden], down [hidden, S]) scaled by sigmoid(shared_gate · x) (fp32 [hidden] or None).
    ``oai``: gpt-oss's experts, OAIExperts (the biases and the clamped SwiGLU)."""

    def __init__(self, experts: int, top_k: int, renormalize: bool, hidden: int, inner: int,
                 router: np.ndarray, router_type: int, gate: tuple[np.ndarray, int], up: tuple[np.ndarray, int] | None,
                 down: tuple[np.ndarray, int], act: str = "silu",
                 shared: tuple[LinearWeights, LinearWeights] | None = None,
                 shared_gate: np.ndarray | None = None, oai: OAIExperts | None = None) -> None:
        native = lib()
        if act not in _ACTS:
            raise ValueError(f"act must be one of {sorted(_ACTS)}, not {act!r}")
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k {top_k} must be in [1, {experts}]")
        self.experts, self.top_k, self.hidden = experts, top_k, hidden
        if router_type == 0:
            router_p = arr(router, F32, "router", 2)
            check_shape("router", router.shape, (experts, hidden))
        else:
            router_p = _stack("router", router, 1, experts, native.runlm_row_bytes(router_type, hidden))
        gate_rows = inner if up is not None else 2 * inner
        gate_p = _stack("gate", gate[0], experts, gate_rows, native.runlm_row_bytes(gate[1], hidden))
        up_p = None if up is None else _stack("up", up[0], experts, inner, native.runlm_row_bytes(up[1], hidden))
        down_p = _stack("down", down[0], experts, hidden, native.runlm_row_bytes(down[1], inner))
        handle = native.runlm_moe_new(experts, top_k, int(renormalize), hidden, inner, router_p, int(router_type),
                                      gate_p, int(gate[1]), up_p, int(up[1]) if up else 0, down_p, int(down[1]),
                                      _ACTS[act])
        super().__init__(handle, "runlm_moe_free", "mixture of experts")
        self._keep = (router, gate, up, down, shared, shared_gate, oai)
        if shared is not None:
            ok(native.runlm_moe_set_shared(handle, shared[0].handle, shared[1].handle,
                                           optional_f32(shared_gate, "shared_gate", hidden)))
        if oai is not None:
            ok(native.runlm_moe_set_oai(handle, optional_f32(oai.router_bias, "router_bias", experts),
                                        optional_f32(oai.gate_up_bias, "gate_up_bias", experts * 2 * inner),
                                        optional_f32(oai.down_bias, "down_bias", experts * hidden), oai.swiglu_limit))

    def forward(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out [T, hidden] = the mixture on x [T, hidden]."""
        xp, op = arr(x, F32, "x", 2), arr(out, F32, "out", 2)
        check_shape("x", x.shape, (x.shape[0], self.hidden))
        check_shape("out", out.shape, x.shape)
        ok(lib().runlm_moe_forward(self.handle, xp, x.shape[0], op))
        return out
