"""ERNIE 4.5 (dense): Llama's layer whose RoPE rotates features (2i, 2i+1) together ("GLM style"), as its
checkpoints are trained; llama.cpp's files keep that layout (its "normal" RoPE), so they read as Llama's do. Biases
(``use_bias``) are refused as weights that do not fit. Not the native runner's from safetensors (its tables rotate
halves there), nor the GPU runner's yet."""
from runlm.models.families import Family

FAMILY = Family("ernie4_5", hf_rope_interleaved=True, native_safetensors=False)
