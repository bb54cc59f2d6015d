"""APIs that are translations of chat completions: OpenAI's Responses (``/v1/responses``) and Anthropic's
Messages (``/v1/messages``). Both servers mount the same routes over a ``ChatSource``: serve-engine runs the
chat completion in-process (runlm/server/chat_source.py), the daemon forwards it to the model's backend
(runlm/runner/chat_source.py), so every backend answers them. Nothing here imports the engine or torch."""
