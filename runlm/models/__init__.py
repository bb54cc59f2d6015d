"""Model architectures (decoders, encoders, poolers), weight loading and LoRA."""
