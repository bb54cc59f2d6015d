"""LLM: offline batched generation (vLLM's ``LLM``)."""
from __future__ import annotations

import itertools
from typing import Any, Mapping, Sequence

from tqdm import tqdm

from runlm.engine.llm_engine import LLMEngine, PromptType, engine_from_model
from runlm.engine.request import RequestOutput
from runlm.engine.sampling_params import SamplingParams
from runlm.formats.chat_template import render_chat
from runlm.formats.tokenizer import Tokenizer

_PROGRESS_MIN = 8  # show a progress bar for batches at least this long


class LLM:
    """``LLM(model).generate(prompts, params)`` -> one RequestOutput per prompt, in order."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.engine: LLMEngine = engine_from_model(model, **engine_args)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, list) and prompts
                                                   and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        order: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = str(next(self._ids))
            self.engine.add_request(rid, prompt, _copy(p), priority=priority[i] if priority else 0)
            order[rid] = i
        return self._run(order, use_tqdm and len(prompts) >= _PROGRESS_MIN)

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [{"prompt_token_ids": self.encode_chat(c, chat_template, add_generation_prompt, tools)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True, tools: list[dict] | None = None) -> list[int]:
        return encode_chat(self.engine.tokenizer, messages, chat_template, add_generation_prompt, tools)

    def _run(self, order: dict[str, int], progress: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not progress, dynamic_ncols=True)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    bar.update(1)
        bar.close()
        return [r for r in results if r is not None]

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()


def encode_chat(tok: Tokenizer, messages: Sequence[Mapping[str, Any]], chat_template: str | None = None,
                add_generation_prompt: bool = True, tools: list[dict] | None = None, **template_kwargs: Any) -> list[int]:
    """A conversation -> prompt token ids, through the model's chat template (LLM.chat and the server)."""
    text = render_chat(messages, chat_template or tok.chat_template, add_generation_prompt=add_generation_prompt,
                       bos_token=tok.bos_token, eos_token=tok.eos_token, tools=tools, **template_kwargs)
    return tok.encode(text, add_special_tokens=not (tok.bos_token and text.startswith(tok.bos_token)))


def _copy(p: SamplingParams) -> SamplingParams:
    """Each request gets its own params (the engine fills in max_tokens when it is None)."""
    from dataclasses import replace

    return replace(p)
