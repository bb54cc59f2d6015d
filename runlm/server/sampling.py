"""Request -> SamplingParams: the one place where a request's fields become engine settings. The
values' bounds are SamplingParams' own; only what is HTTP's (how many stop strings, best_of, suffix,
logit_bias keys written as strings) is checked here.

Structured outputs (``response_format``, ``structured_outputs``, the ``guided_*`` extras, and the
grammar a forcing ``tool_choice`` brings) are translated in runlm/server/structured.py.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runlm.engine.types.sampling_params import SamplingParams, SamplingParamsError
from runlm.server.errors import bad_request
from runlm.server.protocol import ChatCompletionRequest, CompletionRequest
from runlm.server.structured import structured_outputs_for

MAX_STOP_STRINGS = 64
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context end


def to_sampling_params(req: ChatCompletionRequest | CompletionRequest, forced_constraint: dict | None = None,
                       defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """``forced_constraint``: the grammar a forcing tool_choice brings (runlm.tools.choice). ``defaults``: the
    server's sampling defaults (the model's recommended settings under --override-generation-config) for the
    fields the request leaves out; SamplingParams' own defaults come last."""
    d = defaults or {}

    def given(value: Any, name: str, fallback: Any) -> Any:
        return value if value is not None else d.get(name, fallback)

    is_chat = isinstance(req, ChatCompletionRequest)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop if req.stop is not None else d.get("stop") or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}", "stop")
    logit_bias = None
    if req.logit_bias:
        try:
            logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError:
            raise bad_request("logit_bias keys must be token ids (integers written as strings)", "logit_bias") from None
    if isinstance(req, ChatCompletionRequest):
        max_tokens = given(req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
                           "max_tokens", None)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = None
    else:
        max_tokens = given(req.max_tokens, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
        logprobs = req.logprobs
        prompt_logprobs = req.logprobs if (req.echo and req.logprobs is not None) else None
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", "best_of")
    try:
        params = SamplingParams(
            n=req.n, temperature=given(req.temperature, "temperature", 1.0), top_p=given(req.top_p, "top_p", 1.0),
            top_k=given(req.top_k, "top_k", 0), min_p=given(req.min_p, "min_p", 0.0),
            presence_penalty=given(req.presence_penalty, "presence_penalty", 0.0),
            frequency_penalty=given(req.frequency_penalty, "frequency_penalty", 0.0),
            repetition_penalty=given(req.repetition_penalty, "repetition_penalty", 1.0),
            dry_multiplier=given(req.dry_multiplier, "dry_multiplier", 0.0),
            dry_base=given(req.dry_base, "dry_base", 1.75),
            dry_allowed_length=given(req.dry_allowed_length, "dry_allowed_length", 2),
            dry_penalty_last_n=given(req.dry_penalty_last_n, "dry_penalty_last_n", -1),
            penalty_last_n=given(req.repeat_last_n, "penalty_last_n", -1),
            typical_p=given(req.typical_p, "typical_p", 1.0), top_n_sigma=given(req.top_n_sigma, "top_n_sigma", -1.0),
            xtc_probability=given(req.xtc_probability, "xtc_probability", 0.0),
            xtc_threshold=given(req.xtc_threshold, "xtc_threshold", 0.1),
            mirostat=given(req.mirostat, "mirostat", 0), mirostat_tau=given(req.mirostat_tau, "mirostat_tau", 5.0),
            mirostat_eta=given(req.mirostat_eta, "mirostat_eta", 0.1),
            logprobs_mode=req.logprobs_mode or "raw_logprobs",
            seed=req.seed, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
            max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, logit_bias=logit_bias,
            skip_special_tokens=req.skip_special_tokens)
    except SamplingParamsError as exc:  # SamplingParams owns the bounds; name the field as the client sent it
        param = exc.param
        param = {"penalty_last_n": "repeat_last_n"}.get(param, param)
        if is_chat and param == "logprobs":
            param = "top_logprobs"
        elif isinstance(req, ChatCompletionRequest) and param == "max_tokens" \
                and req.max_completion_tokens is not None:
            param = "max_completion_tokens"
        raise bad_request(str(exc), param) from None
    found = structured_outputs_for(req, forced_constraint)
    if found is not None:
        params.structured_outputs = found[1]
        # a grammar makes tokens repeat (quotes, braces, keys): the model's default penalties against repeats
        # would fight it and garble the output; a penalty the request asks for still applies
        if req.repetition_penalty is None:
            params.repetition_penalty = 1.0
        if req.presence_penalty is None:
            params.presence_penalty = 0.0
        if req.frequency_penalty is None:
            params.frequency_penalty = 0.0
        if req.dry_multiplier is None:
            params.dry_multiplier = 0.0
    return params

