"""Gemma 2: scaled embeddings, 1 + w norms, sandwich norms, GELU-tanh, soft-caps, local:global layers 1:1
(runlm.models.gemma). The native runner builds it from GGUF (whose norms hold 1 + w), not from safetensors."""
from runlm.models.families import Family

# llama.cpp's ffn_norm is the norm before the MLP here too, but HF names it apart from the post-attention one
GEMMA_TENSOR_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}

FAMILY = Family("gemma2", torch_model="runlm.models.gemma:GemmaForCausalLM", sliding_window=True, sliding_pattern=2,
                hidden_act="gelu_tanh", scaled_embeddings=True, hf_norm_offset=1.0, sandwich_norms=True,
                gguf_tensor_names=GEMMA_TENSOR_NAMES, native_safetensors=False)
