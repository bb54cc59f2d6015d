"""Mistral: Llama with a sliding window on every layer (where the config sets one)."""
from runlm.models.families import Family

FAMILY = Family("mistral", sliding_window=True)
