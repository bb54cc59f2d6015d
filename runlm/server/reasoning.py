"""Reasoning models over chat completions: which parser a request's answer goes through, what the request
asks of the thinking (kept or not, a token budget, turned off), and the engine's ThinkingParams for a budget
or for a grammar that must start after the thinking.

The split itself is runlm.tools.reasoning's; the thinking goes out as ``reasoning`` and, under its older
name, ``reasoning_content`` (vLLM sends both)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runlm.engine.async_inproc import AsyncLLM
from runlm.engine.types.thinking_params import ThinkingParams
from runlm.server.errors import bad_request
from runlm.server.protocol import ChatCompletionRequest
from runlm.server.state import ServerState
from runlm.tools.reasoning import (
    HarmonySplitter,
    ReasoningParser,
    ReasoningSplitter,
    parser_for_template,
    reasoning_parser,
    split_reasoning,
)

# reasoning_effort -> thinking tokens allowed (None: no limit); "none" turns thinking off in the template
EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": None,
                                         "xhigh": None}
_PROMPT_TAIL = 32  # prompt tokens read to see whether the template opened the thinking


@dataclass(slots=True)
class ReasoningPlan:
    parser: ReasoningParser
    inside: bool          # the prompt opened the thinking
    include: bool         # the client wants the thinking (vLLM's include_reasoning)

    def splitter(self) -> ReasoningSplitter | HarmonySplitter:
        return self.parser.splitter(self.inside)

    def split(self, text: str) -> tuple[str | None, str]:
        return split_reasoning(self.parser, self.inside, text)

    def fields(self, reasoning: str | None) -> dict[str, Any]:
        """The message's (or delta's) thinking fields."""
        value = reasoning if self.include else None
        return {"reasoning": value, "reasoning_content": value}


def model_parser(state: ServerState, engine: AsyncLLM) -> ReasoningParser | None:
    name = state.settings.reasoning_parser
    if name == "none":
        return None
    if name == "auto":
        return parser_for_template(engine.tokenizer.chat_template)
    return reasoning_parser(name)


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """chat_template_kwargs with what reasoning_effort says: "none" turns the thinking off (Qwen3's
    ``enable_thinking``); the effort itself reaches templates that read it (gpt-oss)."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        if req.reasoning_effort not in EFFORT_BUDGETS:
            raise bad_request(f"reasoning_effort must be one of {', '.join(EFFORT_BUDGETS)}", "reasoning_effort")
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        if req.reasoning_effort == "none":
            kwargs.setdefault("enable_thinking", False)
    return kwargs


def thinking_budget(req: ChatCompletionRequest) -> int | None:
    if req.thinking_token_budget is not None:
        if req.thinking_token_budget < 0:
            raise bad_request("thinking_token_budget must be 0 or more", "thinking_token_budget")
        return req.thinking_token_budget
    return EFFORT_BUDGETS.get(req.reasoning_effort) if req.reasoning_effort else None


def reasoning_plan(req: ChatCompletionRequest, state: ServerState, engine: AsyncLLM,
                   prompt: list[int]) -> ReasoningPlan | None:
    parser = model_parser(state, engine)
    if parser is None:
        return None
    tail = engine.tokenizer.decode(prompt[-_PROMPT_TAIL:], skip_special_tokens=False)
    return ReasoningPlan(parser, parser.starts_inside(tail), req.include_reasoning)


def thinking_params(plan: ReasoningPlan | None, req: ChatCompletionRequest, engine: AsyncLLM,
                    constrained: bool) -> ThinkingParams | None:
    """What the engine must know of the thinking: for a budget, and for a grammar that starts after it."""
    budget = thinking_budget(req)
    if plan is None or (budget is None and not constrained):
        return None
    if plan.parser.harmony and constrained:
        # gpt-oss's answer is a channel's message, not what follows a closing tag: a grammar there constrains the
        # whole output (channels and all), and the splitter reads whatever it wrote
        return None
    tok = engine.tokenizer

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)
    return ThinkingParams(end_ids=ids(plan.parser.end), start_ids=ids(plan.parser.start),
                          close_ids=ids(plan.parser.close), inside=plan.inside, budget=budget)
