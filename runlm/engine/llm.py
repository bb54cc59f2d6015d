"""LLM: offline batched generation (vLLM's ``LLM``)."""
from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

from runlm.engine.factory import EngineCoreType, engine_from_model
from runlm.engine.llm_engine import PromptType
from runlm.engine.pooling_engine import PoolingPromptType
from runlm.engine.profiler import EngineProfiler
from runlm.engine.rpc import engine_method
from runlm.engine.scoring import cosine_output, score_pairs
from runlm.engine.types.errors import TaskError
from runlm.engine.types.lora_request import LoRARequest
from runlm.engine.types.outputs import PoolingRequestOutput, RequestOutput
from runlm.engine.types.pooling_params import PoolingParams
from runlm.engine.types.sampling_params import SamplingParams
from runlm.formats.chat_images import take_images
from runlm.formats.chat_template import ChatTemplateError
from runlm.formats.tokenizer import Tokenizer
from runlm.tools.prompt import render_tool_chat

_PROGRESS_MIN = 8  # show a progress bar for batches at least this long


class LLM:
    """``LLM(model).generate(prompts, params)`` -> one RequestOutput per prompt, in order."""

    def __init__(self, model: str | None = None, *, engine: EngineCoreType | None = None,
                 profiler_dir: str | None = None, **engine_args: Any) -> None:
        """``model``: a built-in name, a .gguf file or a model directory; or ``engine``: a built one.
        ``profiler_dir``: where start_profile()/stop_profile() write traces (else $RUNLM_TORCH_PROFILER_DIR)."""
        if (model is None) == (engine is None):
            raise ValueError("give either a model or an engine")
        self.engine: EngineCoreType = engine or engine_from_model(str(model), **engine_args)
        self._ids = itertools.count()
        self._profiler = EngineProfiler(profiler_dir)

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """``lora_request``: one adapter for every prompt, or one (or None) per prompt."""
        prompts = _as_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        loras = _per_prompt(lora_request, len(prompts))
        order: dict[str, int] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, _copy(p), priority=priority[i] if priority else 0,
                                        lora_request=loras[i])
                order[rid] = i
        except Exception:
            self.engine.abort_request(list(order))  # all or nothing: a bad prompt leaves no strays behind
            raise
        return self._run(order, use_tqdm and len(prompts) >= _PROGRESS_MIN)

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             tools: list[dict] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; rendered with the model's chat template. A message's
        content may hold images: ``{"type": "image", "image": PIL image or bytes}``, ``{"type": "image_url",
        "image_url": {"url": "data:image/png;base64,..."}}`` (runlm.formats.chat_images)."""
        conversations = cast(list[Sequence[Mapping[str, Any]]],
                             [messages] if messages and isinstance(messages[0], Mapping) else list(messages))
        prompts = []
        for c in conversations:
            messages_, images = take_images(c)
            prompt: dict[str, Any] = {"prompt_token_ids": self.encode_chat(messages_, chat_template,
                                                                          add_generation_prompt, tools)}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True, tools: list[dict] | None = None) -> list[int]:
        return encode_chat(self.engine.tokenizer, messages, chat_template, add_generation_prompt, tools)

    def _run(self, order: dict[str, int], progress: bool) -> list:
        from tqdm import tqdm  # (imported when used: a few MB resident)

        results: list[RequestOutput | PoolingRequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not progress, dynamic_ncols=True)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    bar.update(1)
            failed = [exc for rid, exc in self.engine.take_failures() if rid in order]
            if failed:  # (a step ran out of memory: the rest of the batch is stopped, the engine is fine)
                self.engine.abort_request([rid for rid in order if results[order[rid]] is None])
                bar.close()
                raise failed[0]
        bar.close()
        return [r for r in results if r is not None]

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def reset_mm_cache(self) -> None:
        """Forget the images' embeddings (the encoder cache)."""
        self.engine.reset_mm_cache()

    # ---- profiling and named engine methods (the engine steps on the caller's thread) ---------
    def start_profile(self) -> None:
        """Trace what runs until stop_profile() with torch.profiler (see runlm/engine/profiler.py)."""
        self._profiler.start(self.engine)

    def stop_profile(self) -> list[str]:
        """Write the trace as Chrome trace JSON; returns its path (in a list, as AsyncLLM's replicas)."""
        return [self._profiler.stop()]

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run the engine core's public method ``method``; one result per engine (here one)."""
        return [engine_method(self.engine, method)(*args, **(kwargs or {}))]

    # ---- LoRA adapters ------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        return self.engine.pin_lora(lora_id)

    # ---- pooling models (embeddings, scores) ------------------------------------------------
    def get_supported_tasks(self) -> tuple[str, ...]:
        return self.engine.supported_tasks

    def encode(self, prompts: PoolingPromptType | Sequence[PoolingPromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[PoolingRequestOutput]:
        """One PoolingRequestOutput per prompt, in order, batched by the engine's scheduler."""
        prompts = _as_list(prompts)
        loras = _per_prompt(lora_request, len(prompts))
        params = pooling_params if isinstance(pooling_params, Sequence) else [pooling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} pooling params for {len(prompts)} prompts")
        order: dict[str, int] = {}
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p, lora_request=lora)
                order[rid] = len(order)
        except Exception:
            self.engine.abort_request(list(order))  # all or nothing: a bad prompt leaves no strays behind
            raise
        return self._run(order, use_tqdm and len(prompts) >= _PROGRESS_MIN)

    def embed(self, prompts: PoolingPromptType | Sequence[PoolingPromptType],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Embeddings: ``out.outputs.embedding`` (a list) or ``out.outputs.data`` (a tensor)."""
        return self.encode(prompts, pooling_params or PoolingParams(task="embed"), use_tqdm)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Relevance of each pair (text_1 against one or each of text_2): a cross-encoder's score, or the
        cosine similarity of the two embeddings for an embedding model. ``out.outputs.score``."""
        pairs = score_pairs(text_1, text_2)
        if "score" in self.get_supported_tasks():
            return self.encode([{"text": a, "text_pair": b} for a, b in pairs], PoolingParams(task="score"),
                               use_tqdm)
        if "embed" not in self.get_supported_tasks():
            raise TaskError("scores need a reranking (cross-encoder) or embedding model")
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text embedded once
        outs = dict(zip(texts, self.encode(texts, PoolingParams(task="embed", normalize=True), use_tqdm)))
        return [cosine_output(outs[a], outs[b]) for a, b in pairs]


def _as_list(prompts: Any) -> list:
    single = isinstance(prompts, (str, Mapping)) or (isinstance(prompts, list) and prompts
                                                       and isinstance(prompts[0], int))
    return [prompts] if single else list(prompts)


def _per_prompt(lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    loras = list(lora)
    if len(loras) != n:
        raise ValueError(f"{len(loras)} LoRA requests for {n} prompts")
    return loras


def encode_chat(tok: Tokenizer, messages: Sequence[Mapping[str, Any]], chat_template: str | None = None,
                add_generation_prompt: bool = True, tools: list[dict] | None = None,
                continue_final_message: bool = False, **template_kwargs: Any) -> list[int]:
    """A conversation -> prompt token ids, through the model's chat template (LLM.chat and the server).
    ``continue_final_message``: the last message (the assistant's) is left open for the model to go on with,
    as transformers' and vLLM's flag of that name. A model made from a Modelfile puts its SYSTEM prompt and
    MESSAGE history around the conversation (the tokenizer's ``chat_defaults``)."""
    if tok.chat_defaults is not None:
        messages = tok.chat_defaults.chat([dict(m) for m in messages])
    text = render_tool_chat(messages, chat_template or tok.chat_template, add_generation_prompt=add_generation_prompt,
                            bos_token=tok.bos_token, eos_token=tok.eos_token, tools=tools, **template_kwargs)
    if continue_final_message:
        text = open_final_message(text, messages[-1].get("content") if messages else None)
    return tok.encode(text, add_special_tokens=not (tok.bos_token and text.startswith(tok.bos_token)))


def _copy(p: SamplingParams) -> SamplingParams:
    """Each request gets its own params (the engine fills in max_tokens when it is None)."""
    return replace(p)


def open_final_message(text: str, content: Any) -> str:
    """The rendered conversation cut just after the final message's text (what closes it is dropped)."""
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    final = (content or "").strip()
    at = text.rfind(final) if final else -1
    if at < 0:
        raise ChatTemplateError("continue_final_message: the final message's text is not in the rendered prompt")
    return text[:at + len(final)]
