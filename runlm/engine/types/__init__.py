"""The engine's vocabulary: its config, request parameters, outputs and typed errors (no engine state)."""
