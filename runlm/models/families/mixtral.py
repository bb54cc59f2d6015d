"""Mixtral: Llama with a mixture of experts in every layer, top-k always renormalized."""
from runlm.models.families import Family

FAMILY = Family("mixtral", torch_model="runlm.models.moe:MoeForCausalLM", norm_topk_prob=True,
                gguf_norm_topk_prob=True)
