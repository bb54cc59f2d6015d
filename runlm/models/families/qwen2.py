"""Qwen2: biases on q, k and v (not on o_proj), also where the config does not say."""
from runlm.models.families import Family

FAMILY = Family("qwen2", attention_bias=True, o_proj_bias=False)
