"""serve-engine's chat source for the translated APIs (runlm/apis): chat completions run in-process, the same
``start_chat`` the /v1/chat/completions route runs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from runlm.apis.source import ChatStream
from runlm.server.chat import ChatRun, start_chat
from runlm.server.errors import bad_request
from runlm.server.prompts import chat_prompt_ids
from runlm.server.protocol import ChatCompletionRequest
from runlm.server.state import ServerState
from runlm.server.tool_calls import tool_plan
from runlm.web.json_body import JSONBodyError, validate_body


def _validated(body: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return validate_body(ChatCompletionRequest, body)
    except JSONBodyError as exc:
        raise bad_request(str(exc), exc.param) from None


@dataclass(slots=True)
class EngineChatSource:
    request: Request

    async def _start(self, body: dict[str, Any]) -> ChatRun:
        return await start_chat(self.request, _validated(body))

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        return await (await self._start(body)).whole()

    async def open_stream(self, body: dict[str, Any]) -> ChatStream:
        run = await self._start(body)

        async def close() -> None:
            run.close()
        return ChatStream(run.chunks(), close)

    async def count_tokens(self, body: dict[str, Any]) -> int:
        req = _validated(body)
        state: ServerState = self.request.app.state.server
        state.check_model(req.model)
        engine = state.require_task("generate", "chat completions")
        plan = tool_plan(req, engine)
        ids = await chat_prompt_ids(engine, req.messages, True, plan.template_tools, req.chat_template_kwargs,
                                    state.settings.trust_request_chat_template, media=state.settings.media,
                                    model=state.model_name)
        return len(ids)
