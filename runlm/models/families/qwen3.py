"""Qwen3: per-head q/k RMSNorm before RoPE."""
from runlm.models.families import Family

FAMILY = Family("qwen3", qk_norm=True)
