"""Qwen3-MoE: Qwen3's attention, experts (llama.cpp renormalizes the top-k where the file does not say)."""
from runlm.models.families import Family

FAMILY = Family("qwen3_moe", torch_model="runlm.models.moe:MoeForCausalLM", qk_norm=True, gguf_norm_topk_prob=True,
                )
