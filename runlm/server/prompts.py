"""Prompts from requests: chat messages through the chat template, completion prompts as given.

Only what is HTTP's is checked here (message roles and content parts, how many prompts, OpenAI's
prompt + max_tokens rule); whether a prompt fits the model (empty, too long, token ids, KV blocks)
is the engine's check, raised as a typed error when the request is added (runlm/engine/types/errors.py)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from runlm.engine.async_inproc import AsyncLLM
from runlm.engine.llm import encode_chat
from runlm.engine.types.sampling_params import SamplingParams
from runlm.formats.chat_template import ChatTemplateError, ChatTemplateLimitError
from runlm.formats.template_limits import RenderLimitError
from runlm.server.errors import APIError, bad_request
from runlm.server.media import IMAGE_PARTS, OTHER_MEDIA, CheckedImage, MediaSettings, take_images
from runlm.server.render import render_off_loop

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# keys render_chat sets itself; chat_template_kwargs may not override them
_RESERVED = {"messages", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token", "tools"}


def _check_content(content: Any, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind in IMAGE_PARTS:  # read and checked by runlm.server.media.take_images
            continue
        if kind in OTHER_MEDIA:
            raise bad_request(f"{where}[{j}]: {kind} inputs are not supported (runlm's models take text and images)",
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


async def chat_prompt_ids(engine: AsyncLLM, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                          tools: list[dict] | None, template_kwargs: Mapping[str, Any] | None,
                          trust_request_template: bool, continue_final_message: bool = False,
                          media: MediaSettings | None = None, model: str = "") -> list[int]:
    """chat_prompt's token ids, each image's placeholder expanded to the tokens it takes where the engine runs in
    this process (what /tokenize and count_tokens report); a data-parallel front end counts each image's
    placeholder only."""
    ids, images = await chat_prompt(engine, messages, add_generation_prompt, tools, template_kwargs,
                                    trust_request_template, continue_final_message, media, model)
    vision = getattr(getattr(engine, "engine", None), "vision", None)
    if not images or vision is None:
        return ids
    try:
        placed = await asyncio.to_thread(vision.processor.process, ids, [i.image for i in images])
    except ValueError as exc:  # (a family's own refusal, e.g. too many tiles)
        raise bad_request(str(exc), "messages") from None
    return list(placed.token_ids)


async def chat_prompt(engine: AsyncLLM, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                      tools: list[dict] | None, template_kwargs: Mapping[str, Any] | None,
                      trust_request_template: bool, continue_final_message: bool = False,
                      media: MediaSettings | None = None, model: str = "") -> tuple[list[int], list[CheckedImage]]:
    """The prompt's token ids, rendered off the event loop within the template limits, and its images (encoded,
    checked, in order; the template sees ``{"type": "image"}`` where each was). A template given in
    the request (``chat_template_kwargs.chat_template``) replaces the model's only on a server started
    with --trust-request-chat-template."""
    extra = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED}
    template = extra.pop("chat_template", None)
    if template is not None and not trust_request_template:
        raise bad_request("this server does not take chat templates from requests (start it with "
                          "--trust-request-chat-template to allow them)", "chat_template_kwargs.chat_template")
    if template is not None and not isinstance(template, str):
        raise bad_request("chat_template must be a string", "chat_template_kwargs.chat_template")
    msgs, images = await take_images(normalise_messages(messages), media or MediaSettings(),
                                     getattr(engine, "modalities", ("text",)), model)
    if continue_final_message and msgs[-1]["role"] != "assistant":  # (with add_generation_prompt: chat.py's 400)
        raise bad_request("continue_final_message continues a final assistant message", "continue_final_message")
    try:
        ids = await render_off_loop(lambda: encode_chat(engine.tokenizer, msgs, template,
                                                        add_generation_prompt=add_generation_prompt, tools=tools,
                                                        continue_final_message=continue_final_message, **extra))
        return ids, images
    except (ChatTemplateLimitError, RenderLimitError) as exc:
        # a template past its limits is the template's fault: the client's (400) or the model's (500)
        text = str(exc) if isinstance(exc, ChatTemplateLimitError) else f"chat template failed: {exc}"
        if template is not None:
            raise bad_request(f"the request's {text}", "chat_template_kwargs.chat_template",
                              code="chat_template_limit") from None
        raise APIError(500, f"the model's {text}", code="chat_template_limit") from None
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    except TypeError as exc:  # e.g. a message of the wrong shape for the template
        raise bad_request(f"the messages do not fit the model's chat template: {exc}", "messages") from None


def completion_prompt_ids(engine: AsyncLLM, prompt: Any, max_prompts: int) -> list[list[int]]:
    """``prompt`` as OpenAI allows it: a string, a list of strings, token ids, or lists of token ids.
    Whether the ids fit the model is the engine's check, when the request is added."""
    tok = engine.tokenizer
    return [tok.encode(p) if isinstance(p, str) else list(p) for p in _prompt_list(prompt, max_prompts)]


def _prompt_list(prompt: Any, max_prompts: int) -> list[Any]:
    """OpenAI's ``prompt`` as a list of prompts (each a string or token ids), within the per-request limit."""
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
    return prompts


def fim_prompt_ids(engine: AsyncLLM, prompt: Any, suffix: str, echo: bool, max_prompts: int) -> list[list[int]]:
    """Completions' ``suffix``: each text prompt as the prefix of a fill-in-the-middle prompt built from the
    model's FIM tokens (runlm.formats.fim); a 400 naming why where that cannot be."""
    from runlm.formats.fim import NoFim, suffix_prompt

    if echo:
        raise bad_request("echo cannot be combined with suffix (the prompt is rebuilt around the suffix)", "echo")
    texts = _prompt_list(prompt, max_prompts)
    if not all(isinstance(t, str) for t in texts):
        raise bad_request("suffix needs the prompt as text (the prefix), not token ids", "suffix")
    tok = engine.tokenizer
    try:
        fim = tok.fim
    except NoFim as exc:
        raise bad_request(str(exc), "suffix", "fim_unsupported") from None
    return [suffix_prompt(tok, fim, t, suffix) for t in texts]


Rendered = tuple[list[int], list[Any]]


async def fit_to_context(render: Callable[[list[dict[str, Any]]], Awaitable[Rendered]],
                         messages: list[dict[str, Any]], whole: Rendered, budget: int) -> Rendered:
    """Ollama's truncation: the prompt of the latest messages that fits in ``budget`` tokens, the system messages
    before them always kept and the last message always sent (a conversation whose last message alone is too
    long is left to the context checks). ``whole``: ``messages`` rendered already. The shortest fitting suffix
    is found by bisection (the prompt grows with each message put back), a few renders at most."""
    if len(whole[0]) <= budget or len(messages) < 2:
        return whole

    async def start_at(i: int) -> Rendered:
        kept = [m for m in messages[:i] if m.get("role") in ("system", "developer")]
        return await render(kept + messages[i:])

    low, high = 1, len(messages) - 1  # the answer: the smallest start whose prompt fits (high always may)
    best = await start_at(high)
    if len(best[0]) > budget:
        return best
    while low < high:
        mid = (low + high) // 2
        tried = await start_at(mid)
        if len(tried[0]) <= budget:
            high, best = mid, tried
        else:
            low = mid + 1
    return best


def check_room_for_completion(engine: AsyncLLM, prompts: list[list[int]], params: SamplingParams,
                              param: str) -> None:
    """OpenAI's contract: prompt + max_tokens must fit the context, or the request is a 400 (the engine
    itself would just stop at the context's end with finish_reason 'length', as vLLM's does). A prompt
    that alone does not fit is left to the engine's own check."""
    limit, max_tokens = engine.max_model_len, params.max_tokens
    for ids in prompts:
        if max_tokens is not None and len(ids) < limit < len(ids) + max_tokens:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{len(ids) + max_tokens} tokens ({len(ids)} in the {param}, {max_tokens} in the "
                              f"completion). Please reduce the length of the {param} or completion.",
                              "max_tokens", "context_length_exceeded")
