"""Request bodies (pydantic): what the ``openai`` client can send, with its JSON types checked.

Unknown fields are ignored, as vLLM does, so newer clients keep working. Types are checked here
(strings like "0.5" and booleans are refused where numbers go); the bounds of sampling values are
SamplingParams' (runlm/engine/types/sampling_params.py, the one owner), whose errors name the field, so a
huge value is a 400 naming it. Only limits that are the server's own (list sizes, best_of, priority)
are here. ``response_format``,
``tools``, ``tool_choice`` and the structured-output extras are accepted loosely typed; the
request -> SamplingParams translation (runlm/server/sampling.py) is where they take effect.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

_MAX_INT = 2**31 - 1
Int = StrictInt
Float = StrictFloat  # JSON numbers (ints too); strings like "0.5" and booleans are refused


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=False)


class StreamOptions(_Body):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class LlamaSamplers(_Body):
    """llama-server's samplers by its names: DRY (runlm's looks at generated tokens only), the window
    repetition_penalty looks at (repeat_last_n), typical-p, top-n-sigma, XTC, mirostat."""
    dry_multiplier: Float | None = None
    dry_base: Float | None = None
    dry_allowed_length: Int | None = None
    dry_penalty_last_n: Int | None = None
    repeat_last_n: Int | None = None
    typical_p: Float | None = None
    top_n_sigma: Float | None = None
    xtc_probability: Float | None = None
    xtc_threshold: Float | None = None
    mirostat: Int | None = None
    mirostat_tau: Float | None = None
    mirostat_eta: Float | None = None


class _Sampling(LlamaSamplers):
    """The sampling fields shared by chat and completions (OpenAI's, then vLLM's and llama-server's extras)."""
    model: StrictStr | None = None
    n: Int = 1
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    max_tokens: Int | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[StrictStr, Float] | None = Field(None, max_length=2048)
    user: StrictStr | None = None
    # vLLM extras
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    logprobs_mode: StrictStr | None = None
    ignore_eos: StrictBool = False
    min_tokens: Int = 0
    stop_token_ids: list[Int] | None = Field(None, max_length=1024)
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    priority: Int = Field(0, ge=-_MAX_INT, le=_MAX_INT)
    # a generation that fills the context goes on, its oldest tokens after the first n_keep dropped (llama-server's
    # --context-shift and n_keep, -1: the whole prompt; Ollama's shift); default: the server's --context-shift
    context_shift: StrictBool | None = None
    n_keep: Int = Field(0, ge=-1, le=_MAX_INT)
    # structured outputs (issue 7 hooks them in; accepted here so clients that send them get an answer)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    max_completion_tokens: Int | None = None
    logprobs: StrictBool | None = False
    top_logprobs: Int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Ollama's: a conversation longer than the context loses its oldest messages (system messages and the last
    # one are kept) instead of being refused
    truncate: StrictBool | None = None
    # reasoning models (vLLM's fields; runlm/server/reasoning.py)
    include_reasoning: StrictBool = True
    reasoning_effort: StrictStr | None = None
    thinking_token_budget: Int | None = None


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[Int] | list[list[Int]]
    logprobs: Int | None = None
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    best_of: Int | None = Field(None, ge=1, le=128)


class TokenizeRequest(_Body):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[Int] = Field(..., max_length=1 << 20)

