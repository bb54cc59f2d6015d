"""The native inference engine: continuous batching over a paged KV cache.

Its parts, each importing only those below it (``.importlinter`` holds the order): ``async_llm`` (AsyncLLM as
users import it) → ``parallel/`` (data-parallel front end and replicas) → the front doors (``llm``,
``async_inproc``, ``factory``) → the step loops (``llm_engine``, ``pooling_engine``, ``engine_core``) →
``spec_decode/`` → ``runners/`` (torch, native CPU, pooling) → ``sample/`` → ``structured/`` → ``core/``
(scheduler, KV cache, sequences) → ``types/`` (config, params, outputs, errors).
"""
