"""Qwen2-MoE: Qwen2's attention, experts with a gated shared expert."""
from runlm.models.families import Family

FAMILY = Family("qwen2_moe", torch_model="runlm.models.moe:MoeForCausalLM", attention_bias=True, o_proj_bias=False,
                shared_expert_gate=True)
