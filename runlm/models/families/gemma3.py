"""Gemma 3 (text): Gemma 2's decoder with q/k norms, local:global layers 5:1 and a RoPE base of the local
layers' own."""
from runlm.models.families import Family
from runlm.models.families.gemma2 import GEMMA_TENSOR_NAMES

FAMILY = Family("gemma3", torch_model="runlm.models.gemma:GemmaForCausalLM", qk_norm=True, sliding_window=True,
                sliding_pattern=6, hidden_act="gelu_tanh", scaled_embeddings=True, hf_norm_offset=1.0,
                sandwich_norms=True, gguf_rope_local_theta=10000.0, gguf_tensor_names=GEMMA_TENSOR_NAMES,
                native_safetensors=False)
