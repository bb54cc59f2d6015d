"""Arcee (AFM): Llama's layer with an ungated MLP, up -> ReLU² -> down (ModelConfig.gated_mlp). llama.cpp stores its
Q/K interleaved, as Llama's. Not the native runner's yet (its decoder's MLP is gated)."""
from runlm.models.families import Family

FAMILY = Family("arcee", hidden_act="relu2", gated_mlp=False, native=False, native_safetensors=False)
