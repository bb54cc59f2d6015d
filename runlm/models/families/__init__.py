"""Decoder families: one module each, registered by the names files give them (vLLM's model registry is the
shape). ``runlm.formats.architectures.DECODERS`` is the torch-free index of names (the store and the formats
tell a model's capabilities from it); ``runlm.models.families.<family>`` declares the rest as a ``Family``:

* the config mapping: what a config leaves unsaid, as the family's reference implementation decides it (read by
  runlm.models.config.ModelConfig.from_hf / from_gguf, whose generic reading is every family's), and a hook for
  what is the family's alone;
* its torch model class, by name (imported when a model is built);
* its weight names where llama.cpp's differ from Llama's;
* what the native runner and the GPU runner build of it.

A family module imports no torch and nothing of runlm but this package: it is imported (lazily, on the first
lookup) by the torch-free loaders too.
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from runlm.formats.architectures import DECODER_GGUF_ARCHS, DECODERS, DecoderNames, decoder_family

# (source, the ModelConfig fields read so far) -> the fields the family sets itself. ``source``: the HF config
# (a mapping), or for GGUF a getter of the file's ``<arch>.<key>`` metadata: get(key, default=None).
FieldsHook = Callable[[Any, Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    torch_model: str = "runlm.models.llama:LlamaForCausalLM"  # "module:class", built by runlm.models.load
    # --- the config mapping: where a config does not say
    attention_bias: bool = False         # q/k/v biases (Qwen2: a config without attention_bias has them)
    o_proj_bias: bool = True             # attention_bias covers o_proj too (Qwen2's does not)
    qk_norm: bool = False                # q/k RMSNorm, per head
    qk_norm_whole: bool = False          # ... over the whole projection (OLMoE)
    qk_norm_after_rope: bool = False     # ... on the rotated heads (Hunyuan)
    sliding_window: bool = False         # the config's sliding_window applies unless use_sliding_window is false
    # local:global layers (Gemma): every n-th layer is global where the file names no pattern; the config's
    # per-layer types and its local layers' RoPE base are read for these families only
    sliding_pattern: int | None = None
    hidden_act: str = "silu"             # the MLP's gate activation, whatever the config calls it
    gated_mlp: bool = True               # the MLP is act(gate) * up (False: act(up), no gate)
    scaled_embeddings: bool = False      # embeddings times sqrt(hidden_size)
    # HF checkpoints rotate features (2i, 2i+1) together (ERNIE 4.5), not halves; so do GGUF files of an architecture
    # whose Q/K rows are not turned to halves on loading (runlm.formats.architectures: GLM-4's partial rotary)
    hf_rope_interleaved: bool = False
    hf_norm_offset: float = 0.0          # HF checkpoints store w of an (offset + w) norm; GGUF files the sum
    sandwich_norms: bool = False         # norms after attention and after the MLP as well as before them
    mixer_blocks: bool = False           # each layer one norm and one mixer (ModelConfig.mixer_blocks)
    layer_norm: bool = False             # LayerNorm, not RMSNorm (runlm.models.stablelm's families)
    norm_topk_prob: bool = False         # HF: the chosen experts' probabilities renormalized
    gguf_norm_topk_prob: bool = False    # GGUF: the same, llama.cpp's choice for the architecture
    moe_gating: str = "softmax"          # the router's scores where a config does not say (ModelConfig.moe_gating)
    moe_score_bias: bool = False         # HF: the router has a choice bias (e_score_correction_bias)
    shared_expert_gate: bool = False     # the shared expert's output scaled by a sigmoid gate (Qwen2-MoE)
    gguf_rope_local_theta: float | None = None  # GGUF: the local layers' RoPE base where the file names none
    gguf_with_experts: str | None = None  # GGUF: the family a file of this architecture is when it has experts
    hf_fields: FieldsHook | None = None
    gguf_fields: FieldsHook | None = None
    # --- weights: llama.cpp's per-layer tensor names (``blk.N.<name>``) -> HF's, where they differ from Llama's
    gguf_tensor_names: Mapping[str, str] = field(default_factory=dict)
    # ... and the model's own (``<gguf>`` -> ``<hf>``), where they differ: LFM2's final norm is ``token_embd_norm``
    gguf_global_names: Mapping[str, str] = field(default_factory=dict)
    # Hugging Face checkpoint name fragments -> the torch model's, where they differ (Hunyuan's query_layernorm)
    hf_tensor_names: Mapping[str, str] = field(default_factory=dict)
    # GGUF: weights llama.cpp keeps as metadata (Apertus's xIELU parameters): (the file's metadata, the decoder's
    # layers) -> HF-named values (floats, or lists of them)
    gguf_metadata_weights: Callable[[Mapping[str, Any], int], dict[str, Any]] | None = None
    # --- runners
    native: bool = True                  # the native runner builds it from a GGUF file
    native_safetensors: bool = True      # ... and from a bf16/fp16 safetensors directory

    @property
    def names(self) -> DecoderNames:
        return DECODERS[self.name]

    def torch_class(self) -> Any:
        """The torch model class (imports torch)."""
        module, _, cls = self.torch_model.partition(":")
        return getattr(importlib.import_module(module), cls)


# HF names of DeepSeek-style experts (GLM-4.5, dots1, ERNIE 4.5): "shared_experts", and the choice bias in the router
SHARED_EXPERTS_NAMES = {".mlp.shared_experts.": ".mlp.shared_expert.",
                        ".mlp.gate.e_score_correction_bias": ".mlp.score_bias.bias"}


def global_layers(layer_types: list[str] | None) -> list[int]:
    """The layers ``layer_types`` does not mark sliding-window: those EXAONE 4 and Cohere 2 run without RoPE."""
    return [i for i, t in enumerate(layer_types or []) if t != "sliding_attention"]


# family -> the module declaring it
FAMILIES: dict[str, str] = {name: f"{__name__}.{name}" for name in DECODERS}


@functools.cache
def get(name: str) -> Family:
    """The family ``name`` (a key of FAMILIES; KeyError for any other)."""
    family = importlib.import_module(FAMILIES[name]).FAMILY
    assert isinstance(family, Family) and family.name == name, FAMILIES[name]
    return family


def for_hf(architecture: str | None, model_type: str | None = None) -> Family | None:
    """The family of a Hugging Face config's ``architectures[0]`` (or, failing that, its ``model_type``)."""
    name = decoder_family(architecture, model_type)
    return None if name is None else get(name)


def for_gguf(architecture: str) -> Family | None:
    """The family of a GGUF ``general.architecture`` (before any experts: see Family.gguf_with_experts)."""
    name = DECODER_GGUF_ARCHS.get(architecture)
    return None if name is None else get(name)
