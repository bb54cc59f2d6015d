"""Data parallelism: one front end (DPAsyncLLM) over N engine replicas, in child processes or Ray actors."""
