"""Llama (and SmolLM/SmolLM2, whose GGUF files say "smollm"): the plain decoder every other family varies."""
from runlm.models.families import Family

# a "llama" GGUF file with experts is Mixtral's (its converter writes llama's architecture)
FAMILY = Family("llama", gguf_with_experts="mixtral")
