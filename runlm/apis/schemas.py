"""The request bodies of the translated APIs, as their handlers check them first (a wrong JSON type is a 400
naming the field) and as /openapi.json documents them. Unknown fields are ignored; what the fields mean is
the translation's (responses_request.py, anthropic_request.py)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from runlm.apis.source import bad_request
from runlm.web.json_body import JSONBodyError, parse_json_object, validate_body


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ResponsesRequest(_Body):
    """OpenAI's ``POST /v1/responses``."""
    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    store: StrictBool | None = None
    stream: StrictBool | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, StrictStr] | None = None


class MessagesCountRequest(_Body):
    """Anthropic's ``POST /v1/messages/count_tokens``."""
    model: StrictStr | None = None
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


class MessagesRequest(MessagesCountRequest):
    """Anthropic's ``POST /v1/messages``."""
    max_tokens: StrictInt
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


async def checked_body(raw: bytes, model: type[_Body]) -> dict[str, Any]:
    """The body as a dict, once it has the model's JSON types (or a 400 naming the field)."""
    try:
        body = parse_json_object(raw)
        validate_body(model, body)
    except JSONBodyError as exc:
        raise bad_request(str(exc), exc.param) from None
    return body
