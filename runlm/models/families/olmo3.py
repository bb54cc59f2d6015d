"""OLMo 3: OLMo 2's layer (norms after attention and the MLP, none before; q/k norms over the whole projection) with
sliding-window attention on three layers of four (``layer_types``; every 4th global by default), RoPE on all of
them. llama.cpp writes its GGUF files as ``olmo2`` with the window and the per-layer pattern, which the olmo2 family
reads as they say. Not the native runner's (its decoder normalizes each layer's input)."""
from runlm.models.families import Family
from runlm.models.families.olmo2 import FAMILY as OLMO2

FAMILY = Family("olmo3", torch_model=OLMO2.torch_model, qk_norm=True, qk_norm_whole=True, sliding_window=True,
                sliding_pattern=4, gguf_tensor_names=OLMO2.gguf_tensor_names, native=False, native_safetensors=False)
