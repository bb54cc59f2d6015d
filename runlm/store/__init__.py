"""The model store: names, built-in models and (later) content-addressed blobs."""
