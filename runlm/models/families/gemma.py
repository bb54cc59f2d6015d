"""Gemma (1): Llama's layer with scaled embeddings, 1 + w norms and a GELU-tanh MLP (runlm.models.gemma). The
native runner builds it from GGUF (whose norms hold 1 + w), not from safetensors."""
from runlm.models.families import Family

FAMILY = Family("gemma", torch_model="runlm.models.gemma:Gemma1ForCausalLM", hidden_act="gelu_tanh",
                scaled_embeddings=True, hf_norm_offset=1.0, native_safetensors=False)
