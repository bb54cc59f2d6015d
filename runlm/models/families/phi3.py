"""Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv and gate_up matrices, LongRoPE, partial rotary, a sliding window."""
from runlm.models.families import Family

# Q/K/V stored as one matrix, gate and up as one (ffn_up, the gate's rows first)
FAMILY = Family("phi3", sliding_window=True,
                gguf_tensor_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"})
