"""Chat completions with tools: the plan for a request, and the assistant message (whole or as deltas).

runlm.tools does the work (parsers, tool_choice grammars, prompts); this file turns it into
OpenAI's message and chunk shapes and its errors into 400s.
"""
from __future__ import annotations

from typing import Any

from runlm.engine.async_inproc import AsyncLLM
from runlm.server.errors import bad_request
from runlm.server.protocol import ChatCompletionRequest
from runlm.tools.choice import ToolError, ToolPlan, plan_tools
from runlm.tools.parsers import cut_short_calls, parse_tool_calls
from runlm.tools.streaming import ToolCallStreamer


def tool_plan(req: ChatCompletionRequest, engine: AsyncLLM) -> ToolPlan:
    try:
        return plan_tools(req.tools, req.tool_choice, engine.tokenizer.chat_template,
                          req.parallel_tool_calls)
    except ToolError as exc:
        raise bad_request(str(exc), exc.param) from None


def _finish(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


def whole_message(plan: ToolPlan, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message for a finished choice, and its finish_reason."""
    if plan.parser is None:
        return {"role": "assistant", "content": text, "refusal": None}, reason
    content, calls = parse_tool_calls(plan.parser, text)
    if plan.forced and not calls:  # the grammar was cut short (length): the calls as far as they got
        content, calls = None, cut_short_calls(plan.parser, text)
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:  # OpenAI leaves tool_calls out of a message that has none
        message["tool_calls"] = [c.to_openai() for c in calls]
    return message, _finish(reason, bool(calls))


class DeltaBuilder:
    """One choice's stream: text in, OpenAI chat deltas out."""

    def __init__(self, plan: ToolPlan) -> None:
        self.streamer = ToolCallStreamer(plan.parser) if plan.parser is not None else None

    def delta(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        if self.streamer is None:
            return ({"content": text} if (text or reason is None) else {}), reason
        content, calls = self.streamer.push(text, final=reason is not None)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, _finish(reason, self.streamer.num_calls > 0)
