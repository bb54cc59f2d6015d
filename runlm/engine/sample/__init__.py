"""Choosing tokens: the numpy sampler every runner uses, and rejection sampling for speculative decoding."""
