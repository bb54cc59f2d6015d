"""The model runners behind one interface (prepare, forward, logits, sample): torch, the native CPU runner and
the pooling runner."""
