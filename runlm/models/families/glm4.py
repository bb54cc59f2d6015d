"""GLM-4 (0414): Gemma 2's sandwich of norms around attention and the MLP (runlm.models.gemma; RMSNorm weights as
stored, no embedding scale, SiLU), q/k/v biases but none on o_proj, a fused gate_up matrix, and RoPE rotating feature
pairs (2i, 2i+1) on the first half of each head, in its checkpoints and in llama.cpp's glm4 files alike (the model
rotates pairs for both). Its norm names map to Gemma's. The native runner builds its GGUF files (Gemma's sandwich,
partial RoPE on pairs), not yet its safetensors; not the GPU runner's yet."""
from runlm.models.families import Family
from runlm.models.families.gemma2 import GEMMA_TENSOR_NAMES

FAMILY = Family("glm4", torch_model="runlm.models.gemma:GemmaForCausalLM", attention_bias=True, o_proj_bias=False,
                sandwich_norms=True, hf_rope_interleaved=True,
                # replaced in this order: the post-attention norm is the pre-MLP one before the post-attention
                # name is given to the norm after attention
                hf_tensor_names={"post_attention_layernorm.": "pre_feedforward_layernorm.",
                                 "post_self_attn_layernorm.": "post_attention_layernorm.",
                                 "post_mlp_layernorm.": "post_feedforward_layernorm."},
                gguf_tensor_names={**GEMMA_TENSOR_NAMES, "ffn_up": "mlp.gate_up_proj"},
                native_safetensors=False)
