"""Prompts from requests: chat messages through the chat template, completion prompts as given;
every limit checked here, before the engine sees anything."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from runlm.engine.async_llm import AsyncLLM
from runlm.engine.llm import encode_chat
from runlm.engine.sampling_params import SamplingParams, SamplingParamsError
from runlm.formats.chat_template import ChatTemplateError
from runlm.server.errors import bad_request

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# keys render_chat sets itself; chat_template_kwargs may not override them
_RESERVED = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"}


def _check_content(content: Any, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind in ("image_url", "input_image", "input_audio", "file", "video_url"):
            raise bad_request(f"{where}[{j}]: {kind} inputs are not supported by this model (text only)",
                              f"{where}[{j}]")
        raise bad_request(f"{where}[{j}] must be a content part like {{'type': 'text', 'text': '...'}}",
                          f"{where}[{j}]")


def normalise_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}",
                              f"messages[{i}].role")
        _check_content(m.get("content"), f"messages[{i}].content")
        if m.get("content") is None and role != "assistant":
            raise bad_request(f"messages[{i}].content is required for role {role!r}", f"messages[{i}].content")
        msg = dict(m)
        if role == "developer":  # OpenAI's newer name for system; chat templates know only "system"
            msg["role"] = "system"
        out.append(msg)
    return out


def chat_prompt_ids(engine: AsyncLLM, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    extra = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED}
    try:
        return encode_chat(engine.engine.tokenizer, normalise_messages(messages),
                           add_generation_prompt=add_generation_prompt, tools=tools, **extra)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    except TypeError as exc:  # e.g. a message of the wrong shape for the template
        raise bad_request(f"the messages do not fit the model's chat template: {exc}", "messages") from None


def completion_prompt_ids(engine: AsyncLLM, prompt: Any, max_prompts: int) -> list[list[int]]:
    """``prompt`` as OpenAI allows it: a string, a list of strings, token ids, or lists of token ids."""
    tok = engine.engine.tokenizer
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("prompt must not be empty", "prompt")
    if len(prompts) > max_prompts:
        raise bad_request(f"at most {max_prompts} prompts per request, got {len(prompts)}", "prompt")
    vocab = engine.engine.loaded.config.vocab_size
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(tok.encode(p))
            continue
        bad = next((t for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} in the prompt is outside the vocabulary (size {vocab})", "prompt")
        out.append(list(p))
    return out


def check_prompts(engine: AsyncLLM, prompts: list[list[int]], params: SamplingParams, param: str) -> None:
    """Each prompt, and prompt + max_tokens, must fit the context (the numbers are in the message);
    token ids in the sampling settings must exist."""
    core = engine.engine
    limit = core.max_model_len
    max_tokens = params.max_tokens
    try:
        params.check_vocab(core.loaded.config.vocab_size)
    except SamplingParamsError as exc:
        raise bad_request(str(exc), exc.param) from None
    for ids in prompts:
        if not ids:
            raise bad_request("the prompt is empty", param)
        if len(ids) >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your "
                              f"{param} has {len(ids)} tokens. Please shorten the {param}.", param,
                              "context_length_exceeded")
        if max_tokens is not None and len(ids) + max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{len(ids) + max_tokens} tokens ({len(ids)} in the {param}, {max_tokens} in the "
                              f"completion). Please reduce the length of the {param} or completion.",
                              "max_tokens", "context_length_exceeded")
        needed = core.blocks.blocks_needed(len(ids) + 1)
        if needed > len(core.blocks.blocks):
            raise bad_request(f"the prompt needs {needed} KV-cache blocks but the cache holds only "
                              f"{len(core.blocks.blocks)}; the server needs a larger --kv-cache-memory", param)
