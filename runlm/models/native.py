"""A GGUF decoder computed by runlm's native library alone: no torch in the process.

The fast path's numerics without torch's ~220 MiB: the weights are numpy views of the mapped file in
their stored block types, the norms and RoPE tables small float32 arrays, and one native call
(``kernels.Decoder.forward``) runs every layer of a step (the same kernels, in the same order, as
the torch model's fused loop). Models that need anything else (exact numerics, LoRA, speculative
decoding...) load as torch models.

The families beyond Llama's: Gemma 2/3 (the embedding scale, sandwich norms, attention and final soft-caps,
query_pre_attn_scalar, sliding-window layers with their own KV group and, on Gemma 3, their own RoPE base),
Phi-3 (LongRoPE: the short and long tables stacked, a sequence longer than original_max_position_embeddings
rotating by the long one, as transformers decides it; partial rotary) and OLMoE's q/k norms over the whole
projection.
Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): runlm/models/native_moe.py.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runlm.formats.architectures import gguf_rope_interleaved
from runlm.formats.gguf import GGUFFile, ggml_type
from runlm.formats.readahead import read_ahead
from runlm.formats.tokenizer import Tokenizer
from runlm.models import families
from runlm.models.config import ModelConfig
from runlm.models.native_moe import ROUTERS, layer_experts, why_not_native_moe
from runlm.models.rope_freqs import LONGROPE, inverse_frequencies, longrope, rope_kind, rope_tables
from runlm.models.spec import ModelSpec, as_spec
from runlm.native import kernels

log = logging.getLogger("runlm.native")


def not_its_family(cfg: ModelConfig) -> str:
    """The reason a family the native runner does not build gives: what in it the runner lacks, where it is one
    of the whole designs it has not (recurrent layers, latent attention)."""
    held = "'s recurrent layers, a state per sequence the native runner does not keep" if cfg.recurrent_layers else \
        "'s latent attention (MLA)" if cfg.kv_lora_rank else ""
    return f"the {cfg.family} family{held}"


def why_not_native(gguf: GGUFFile, cfg: ModelConfig) -> str | None:
    """Why this model file cannot run on the native runner (None: it can). What the engine asks of it
    (exact numerics, a device, LoRA...) is the engine's to check (runlm/engine/runners/native.py)."""
    model_reasons = [(not families.get(cfg.family).native, not_its_family(cfg)),
                     (cfg.clip_qkv is not None, "q/k/v clipping"),
                     (cfg.qk_norm_after_rope, "q/k norms after RoPE"),
                     (cfg.norm_offset != 0.0, "offset norms"),
                     (cfg.hidden_act not in ("silu", "gelu_tanh"), f"the {cfg.hidden_act} activation")]
    for bad, what in model_reasons:
        if bad:
            return what
    if not kernels.available():
        return "the native kernels are unavailable"
    if cfg.num_experts and (why := why_not_native_moe(gguf, cfg)) is not None:
        return why
    for name, info in gguf.tensors.items():
        if len(info.shape) == 2 and name.endswith(".weight") and not kernels.supported(ggml_type(info.qtype)) \
                and not (name.endswith(ROUTERS) and info.qtype == "F32"):
            return f"tensor {name} of type {info.qtype}"
    return None


def _vector(gguf: GGUFFile, name: str) -> np.ndarray:
    return np.ascontiguousarray(gguf.load_array(name).reshape(-1), dtype=np.float32)


def _matrix(gguf: GGUFFile, name: str) -> tuple[np.ndarray, int]:
    """(uint8 [rows, row_bytes] view of the mapped file, ggml type)."""
    info = gguf.tensors[name]
    raw = gguf.raw(name)
    return raw.reshape(info.shape[0] if len(info.shape) == 2 else 1, -1), ggml_type(info.qtype)


def _linear(gguf: GGUFFile, names: list[str], cols: int) -> kernels.LinearWeights:
    """The named matrices stacked along their rows (fused projections), with their biases where the file has them."""
    parts = [_matrix(gguf, f"{n}.weight") for n in names]
    biases = [f"{n}.bias" for n in names]
    bias = np.concatenate([_vector(gguf, b) for b in biases]) if all(b in gguf.tensors for b in biases) else None
    return kernels.LinearWeights([p[0] for p in parts], [p[1] for p in parts], cols, bias)


def _rope(gguf: GGUFFile, cfg: ModelConfig, length: int, interleaved: bool) -> tuple[np.ndarray, np.ndarray]:
    """The global layers' cos/sin [length, rotary_dim], as runlm.models.rope builds them; LongRoPE's long table
    follows the short one (rows length..2 length-1: NativeModel.rope_positions picks them)."""
    r = cfg.rotary_dim
    inv, attn = inverse_frequencies(r, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    if "rope_freqs.weight" in gguf.tensors:  # GGUF llama3 models carry their scaling as a tensor
        inv = (inv / _vector(gguf, "rope_freqs.weight")).astype(np.float32)
    cos, sin = rope_tables(inv, attn, length, interleaved)
    if rope_kind(cfg.rope_scaling) in LONGROPE:
        assert cfg.rope_scaling is not None
        long_inv, long_attn = longrope(r, cfg.rope_theta, cfg.rope_scaling, "long_factor")
        long_cos, long_sin = rope_tables(long_inv, long_attn, length, interleaved)
        cos, sin = np.concatenate((cos, long_cos)), np.concatenate((sin, long_sin))
    return cos, sin


def _norm(gguf: GGUFFile, name: str) -> np.ndarray | None:
    return _vector(gguf, name) if name in gguf.tensors else None


@dataclass
class NativeModel:
    """forward(...) -> final-normed hidden [T, H]; compute_logits(hidden) -> [N, vocab] (float32 numpy).
    ``long_rope_after``: LongRoPE's original_max_position_embeddings (None: one RoPE table), ``rope_len`` the
    positions each table covers."""
    config: ModelConfig
    decoder: kernels.Decoder | None
    head: kernels.LinearWeights | None
    gguf: GGUFFile | None  # keeps the mapping (the weights' memory) alive
    long_rope_after: int | None = None
    rope_len: int = 0

    @classmethod
    def load(cls, gguf: GGUFFile, cfg: ModelConfig, max_positions: int) -> NativeModel:
        h, d = cfg.hidden_size, cfg.head_dim
        # (GLM-4's files rotate pairs unpermuted: its family's layout, as the torch model reads them)
        interleaved = gguf_rope_interleaved(gguf.architecture) or families.get(cfg.family).hf_rope_interleaved
        cos, sin = _rope(gguf, cfg, max_positions, interleaved)
        local = cos, sin  # sliding-window layers with a RoPE base of their own (Gemma 3) rotate unscaled
        if cfg.rope_local_theta:
            local = rope_tables(inverse_frequencies(d, cfg.rope_local_theta, None, max_positions)[0], 1.0,
                                max_positions, interleaved)
        nope = np.ones_like(cos), np.zeros_like(sin)  # a layer without RoPE rotates by identity tables (SmolLM3)
        windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
        fused_qkv, layers = "blk.0.attn_qkv.weight" in gguf.tensors, []
        for i in range(cfg.num_layers):
            b = f"blk.{i}"
            qkv = [f"{b}.attn_qkv"] if fused_qkv else [f"{b}.attn_q", f"{b}.attn_k", f"{b}.attn_v"]
            # Phi-3 stores gate and up as one ffn_up matrix, the gate's rows first
            fused_gate_up = f"{b}.ffn_gate.weight" not in gguf.tensors
            gate_up = [f"{b}.ffn_up"] if fused_gate_up else [f"{b}.ffn_gate", f"{b}.ffn_up"]
            layer_cos, layer_sin = nope if i in cfg.nope_layers else local if windows[i] else (cos, sin)
            moe = cfg.is_moe_layer(i)  # its experts replace gate_up / down
            # the norm before the MLP is ffn_norm; Seed-OSS's files call it post_attention_norm, which a file with
            # both (Gemma's sandwich) holds as the norm of the attention's output
            has_ffn_norm = f"{b}.ffn_norm.weight" in gguf.tensors
            mlp_norm = f"{b}.ffn_norm.weight" if has_ffn_norm else f"{b}.post_attention_norm.weight"
            layers.append(kernels.DecoderLayer(
                qkv=_linear(gguf, qkv, h), o=_linear(gguf, [f"{b}.attn_output"], cfg.num_heads * d),
                gate_up=None if moe else _linear(gguf, gate_up, h),
                down=None if moe else _linear(gguf, [f"{b}.ffn_down"], cfg.intermediate_size),
                moe=layer_experts(gguf, cfg, i, lambda names, cols: _linear(gguf, names, cols)) if moe else None,
                input_norm=_vector(gguf, f"{b}.attn_norm.weight"), post_norm=_vector(gguf, mlp_norm),
                q_norm=_norm(gguf, f"{b}.attn_q_norm.weight"), k_norm=_norm(gguf, f"{b}.attn_k_norm.weight"),
                cos=layer_cos, sin=layer_sin, scale=(cfg.query_pre_attn_scalar or d) ** -0.5, window=windows[i],
                softcap=cfg.attn_logit_softcap, act=cfg.hidden_act,
                # Gemma's sandwich norms: the attention's and the MLP's outputs normalized before the residual add
                attn_out_norm=_norm(gguf, f"{b}.post_attention_norm.weight") if has_ffn_norm else None,
                mlp_out_norm=_norm(gguf, f"{b}.post_ffw_norm.weight"),
                family=kernels.LayerFamily(rotary=cfg.rotary_dim if cfg.rotary_dim != d else 0,
                                           qk_norm_whole=cfg.qk_norm_whole),
                sinks=_norm(gguf, f"{b}.attn_sinks.weight")))
        embed, embed_type = _matrix(gguf, "token_embd.weight")
        decoder = kernels.Decoder(hidden=h, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=d,
                                  eps=cfg.rms_norm_eps, interleaved=interleaved,
                                  embed_table=embed, embed_qtype=embed_type,
                                  final_norm=_vector(gguf, "output_norm.weight"), layers=layers,
                                  embed_scale=cfg.embed_scale or 1.0)
        head = _linear(gguf, ["output" if "output.weight" in gguf.tensors else "token_embd"], h)
        long_after = (int(cfg.rope_scaling["original_max_position_embeddings"])
                      if cfg.rope_scaling is not None and rope_kind(cfg.rope_scaling) in LONGROPE else None)
        return cls(cfg, decoder, head, gguf, long_after, max_positions)

    def rope_positions(self, positions: np.ndarray, query_lens: list[int], context_lens: list[int]) -> np.ndarray:
        """The RoPE table rows of a step's rows: their positions, but with LongRoPE every row of a sequence whose
        context is longer than original_max_position_embeddings takes the long table's (transformers' rule)."""
        if self.long_rope_after is None:
            return positions
        if positions.size and int(positions.max()) >= self.rope_len:  # past the short table: the long one's rows
            raise ValueError(f"position {int(positions.max())} is past the rope table ({self.rope_len} positions)")
        if max(context_lens, default=0) <= self.long_rope_after:
            return positions
        long = np.repeat(np.asarray(context_lens) > self.long_rope_after, query_lens)
        return positions + long * self.rope_len

    def compute_logits(self, hidden: np.ndarray) -> np.ndarray:
        assert self.head is not None, "the model's weights were released (sleep level 2)"
        out = np.empty((hidden.shape[0], self.head.rows), dtype=np.float32)
        logits = kernels.linear(np.ascontiguousarray(hidden), self.head, out)
        cap = self.config.final_logit_softcap
        if cap:  # Gemma 2: cap * tanh(logits / cap), as the torch model computes it
            np.tanh(np.divide(logits, np.float32(cap), out=logits), out=logits)
            logits *= np.float32(cap)
        return logits

    def release_weights(self) -> None:
        """Drop every view of the file (sleep level 2); wake_up loads the model again."""
        self.decoder = self.head = self.gguf = None


@dataclass(slots=True)
class NativeLoaded:
    """What LLMEngine keeps of a model: the same fields as runlm.models.load.LoadedModel."""
    model: NativeModel
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    vision: Any = None  # a vision-language model's tower (torch's, from an mmproj file): runlm.models.vision


def not_native(path: Path, reason: str, reasons: list[str] | None) -> None:
    """Say why the model at ``path`` is not the native runner's (the log; ``reasons``, for the engine's line)."""
    log.info("native runner not used for %s: %s", path.name, reason)
    if reasons is not None:
        reasons.append(reason)


def why_not_native_gguf(spec: ModelSpec) -> str | None:
    """Why this GGUF model cannot run on the native runner (None: it can)."""
    if spec.gguf is None or spec.config is None:  # not a decoder this runner knows: the torch loader reports it
        return "a model file the native loader does not read"
    return why_not_native(spec.gguf, spec.config)


def native_loaded(spec: ModelSpec, model: NativeModel) -> NativeLoaded:
    """The loaded model, its mapped files being read into the page cache meanwhile (runlm.formats.readahead)."""
    read_ahead(spec.weight_maps())
    return NativeLoaded(model, model.config, spec.tokenizer(), spec.path)


def build_native(spec: ModelSpec, max_model_len: int | None = None) -> NativeLoaded:
    """The GGUF model of ``spec`` (which why_not_native_gguf accepted) on the native runner."""
    assert spec.gguf is not None and spec.config is not None
    return native_loaded(spec, NativeModel.load(spec.gguf, spec.config, spec.config.context_length(max_model_len)))


def load_native(model: ModelSpec | Path, max_model_len: int | None = None,
                reasons: list[str] | None = None) -> NativeLoaded | None:
    """The GGUF model (a spec or its path) on the native runner, or None (logged, with the reason, which is also
    appended to ``reasons``) where it needs torch."""
    if isinstance(model, Path) and not model.is_file():
        return None
    spec = as_spec(model)
    reason = why_not_native_gguf(spec)
    if reason is not None:
        not_native(spec.path, reason, reasons)
        return None
    return build_native(spec, max_model_len)
