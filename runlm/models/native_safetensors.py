"""A safetensors model directory (Llama, Mistral, Qwen2, Qwen3, Phi-3) on the native runner, half-size.

The weights stay as stored: bf16 and fp16 matrices are numpy views of the memory-mapped files, computed on
by ggml's BF16 / F16 dot products (the activations rounded to the weights' type per row, as llama.cpp
does), so the process holds about the files' size, never an fp32 copy; norms and biases are small fp32
arrays. This is what the torch runner's fast path computes on the same directory (runlm.models.weights
keeps bf16/fp16 matrices as GGMLWeight views there too, and its fused loop calls the same kernels), so the
tokens and logits are the same.

The compute dtype (EngineConfig.dtype) is float32 here: activations, norms, attention and the KV cache are
fp32 whatever the weights' type. Asking for bfloat16 or float16 compute is the torch runner's (it casts
the model and halves the KV cache). fp32 matrices run natively once ggml's F32 type is supported
(``kernels.supported``); until then such a checkpoint loads as a torch model.

Hugging Face's checkpoints keep Q and K rows in the rotate-half RoPE layout (GGUF permutes them to
interleaved pairs), so the decoder rotates with ``interleaved=False``.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

from runlm.formats import ModelFormatError
from runlm.formats.gguf import ggml_type
from runlm.formats.safetensors import SafetensorsDir
from runlm.models import families
from runlm.models.config import ModelConfig
from runlm.models.native import NativeLoaded, NativeModel, native_loaded, not_its_family, not_native, why_not_native
from runlm.models.rope_freqs import LONGROPE, inverse_frequencies, rope_kind, rope_tables
from runlm.models.spec import ModelSpec, as_spec
from runlm.native import kernels

if TYPE_CHECKING:
    from runlm.formats.gguf import GGUFFile

log = logging.getLogger("runlm.native")


def why_not_native_dir(st: SafetensorsDir, cfg: ModelConfig, hf_config: dict) -> str | None:
    """Why this checkpoint cannot run on the native runner (None: it can); the model's own reasons are
    runlm.models.native.why_not_native's, which reads the tensors' types as it does a GGUF file's."""
    archs = hf_config.get("architectures") or []
    reasons = [(bool(hf_config.get("quantization_config")), "a quantized checkpoint"),
               (any(not a.endswith("ForCausalLM") for a in archs), f"the {archs[0] if archs else ''} architecture"),
               ("vision_config" in hf_config or "text_config" in hf_config, "a vision-language model"),
               ((st.directory / "modules.json").exists(), "a sentence-transformers model"),
               # what runlm.models.native's GGUF loader builds and this one does not (yet)
               (not families.get(cfg.family).native_safetensors, not_its_family(cfg)),
               (cfg.sliding_window is not None or cfg.layer_types is not None, "sliding-window layers"),
               (cfg.rotary_dim != cfg.head_dim or rope_kind(cfg.rope_scaling) in LONGROPE,
                "partial rotary or LongRoPE")]
    reason = next((what for bad, what in reasons if bad), None)
    if reason is not None:
        return reason
    for name, info in st.tensors.items():
        if info.qtype not in ("F32", "F16", "BF16"):
            return f"tensor {name} of dtype {info.qtype}"
    # the duck type is deliberate: SafetensorsDir offers the `tensors` why_not_native reads of a GGUF file
    return why_not_native(cast("GGUFFile", st), cfg)


def _vector(st: SafetensorsDir, name: str) -> np.ndarray:
    return np.ascontiguousarray(st.load_array(name).reshape(-1), dtype=np.float32)


def _linear(st: SafetensorsDir, names: list[str], cols: int) -> kernels.LinearWeights:
    """The named matrices stacked along their rows (fused projections), with their biases where the checkpoint
    has them: each matrix a view of the mapped file in its stored type."""
    weights = [f"{n}.weight" for n in names]
    missing = [w for w in weights if w not in st.tensors]
    if missing:
        raise ModelFormatError(f"{st.directory}: the checkpoint lacks {missing[0]!r}")
    for w in weights:
        if len(st.tensors[w].shape) != 2 or st.tensors[w].shape[1] != cols:
            raise ModelFormatError(f"{st.directory}: {w} is {list(st.tensors[w].shape)}, not [rows, {cols}]")
    biases = [f"{n}.bias" for n in names]
    bias = np.concatenate([_vector(st, b) for b in biases]) if all(b in st.tensors for b in biases) else None
    return kernels.LinearWeights([st.raw(w) for w in weights], [ggml_type(st.tensors[w].qtype) for w in weights],
                                 cols, bias)


def _optional(st: SafetensorsDir, name: str) -> np.ndarray | None:
    return _vector(st, name) if name in st.tensors else None


def build(st: SafetensorsDir, cfg: ModelConfig, max_positions: int) -> NativeModel:
    """The native decoder over the checkpoint's tensors (HF names), as runlm.models.native.NativeModel.load
    builds it over a GGUF file's."""
    h, d = cfg.hidden_size, cfg.head_dim
    inv, attn = inverse_frequencies(d, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    cos, sin = rope_tables(inv, attn, max_positions, interleaved=False)
    nope = np.ones_like(cos), np.zeros_like(sin)  # a layer without RoPE rotates by identity tables (SmolLM3)
    layers = []
    for i in range(cfg.num_layers):
        b = f"model.layers.{i}"
        fused_qkv = f"{b}.self_attn.qkv_proj.weight" in st.tensors  # Phi-3's projections are stored fused
        qkv = [f"{b}.self_attn.qkv_proj"] if fused_qkv else [f"{b}.self_attn.{p}_proj" for p in "qkv"]
        fused_gate_up = f"{b}.mlp.gate_up_proj.weight" in st.tensors
        gate_up = [f"{b}.mlp.gate_up_proj"] if fused_gate_up else [f"{b}.mlp.gate_proj", f"{b}.mlp.up_proj"]
        layers.append(kernels.DecoderLayer(
            qkv=_linear(st, qkv, h), o=_linear(st, [f"{b}.self_attn.o_proj"], cfg.num_heads * d),
            gate_up=_linear(st, gate_up, h), down=_linear(st, [f"{b}.mlp.down_proj"], cfg.intermediate_size),
            input_norm=_vector(st, f"{b}.input_layernorm.weight"),
            post_norm=_vector(st, f"{b}.post_attention_layernorm.weight"),
            q_norm=_optional(st, f"{b}.self_attn.q_norm.weight"), k_norm=_optional(st, f"{b}.self_attn.k_norm.weight"),
            cos=nope[0] if i in cfg.nope_layers else cos, sin=nope[1] if i in cfg.nope_layers else sin,
            scale=(cfg.query_pre_attn_scalar or d) ** -0.5, window=None, softcap=None,
            act=cfg.hidden_act))
    embed = "model.embed_tokens"
    if f"{embed}.weight" not in st.tensors:
        raise ModelFormatError(f"{st.directory}: the checkpoint lacks '{embed}.weight'")
    decoder = kernels.Decoder(hidden=h, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=d,
                              eps=cfg.rms_norm_eps, interleaved=False, embed_table=st.raw(f"{embed}.weight"),
                              embed_qtype=ggml_type(st.tensors[f"{embed}.weight"].qtype),
                              final_norm=_vector(st, "model.norm.weight"), layers=layers)
    # tied: the logits read the embedding's own rows (a tied checkpoint's copy of lm_head is ignored, as torch does)
    head = _linear(st, [embed if cfg.tie_word_embeddings else "lm_head"], h)
    return NativeModel(cfg, decoder, head, None)  # the views keep the mappings alive


def why_not_native_spec_dir(spec: ModelSpec) -> str | None:
    """Why the model directory of ``spec`` cannot run on the native runner (None: it can)."""
    if spec.vision is not None:  # its text config is nested: torch's to read
        return "a vision-language model directory"
    if spec.config is None or spec.hf_config is None:  # the torch loader says what is wrong
        return "a model directory the native loader does not read"
    try:
        st = spec.safetensors()
    except (OSError, ValueError):  # ModelFormatError is a ValueError
        return "a model directory the native loader does not read"
    return why_not_native_dir(st, spec.config, spec.hf_config)


def build_native_safetensors(spec: ModelSpec, max_model_len: int | None = None) -> NativeLoaded:
    """The directory of ``spec`` (which why_not_native_spec_dir accepted) on the native runner."""
    assert spec.config is not None
    return native_loaded(spec, build(spec.safetensors(), spec.config, spec.config.context_length(max_model_len)))


def load_native_safetensors(model: ModelSpec | Path, max_model_len: int | None = None,
                            reasons: list[str] | None = None) -> NativeLoaded | None:
    """The model directory (a spec or its path) on the native runner, or None (logged, with the reason, which is
    also appended to ``reasons``) where it needs torch, or where it is not a model this runner knows (the torch
    loader then reports what is wrong)."""
    try:
        spec = as_spec(model)
    except (OSError, ValueError):  # ModelFormatError is a ValueError
        not_native(Path(model) if not isinstance(model, ModelSpec) else model.path,
                   "a model directory the native loader does not read", reasons)
        return None
    reason = why_not_native_spec_dir(spec)
    if reason is not None:
        not_native(spec.path, reason, reasons)
        return None
    return build_native_safetensors(spec, max_model_len)
