"""Speculative decoding: n-gram and draft-model proposers, and the decoder that verifies their drafts."""
