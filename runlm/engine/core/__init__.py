"""What a step is scheduled over: the scheduler, the paged KV cache and prefix cache, sequences, the step plan,
the detokenizer and the loaded LoRA adapters."""
