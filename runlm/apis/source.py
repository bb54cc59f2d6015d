"""What the translated APIs need from a server: a chat completion, whole or as chunks, and a token count.

Requests and answers are chat-completion JSON (dicts), the one shape both servers already speak. Errors
from either server (serve-engine's APIError, the daemon's RunnerError) carry ``status`` and ``message``;
``ProtocolError`` is this package's own, and ``error_fields`` reads any of them."""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from runlm.web.sse_text import sse_json


class ProtocolError(Exception):
    """A request the translation refuses (or an error a backend answered with)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class ChunkError(Exception):
    """An error event inside a chat stream (the backend failed mid-answer)."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message", "the answer failed"))
        self.error = error


def chunk_parts(chunk: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """A chat stream chunk's choices and usage; an error event raises ChunkError."""
    if "error" in chunk and "choices" not in chunk:
        err = chunk["error"]
        raise ChunkError(err if isinstance(err, dict) else {"message": str(err)})
    return chunk.get("choices") or [], chunk.get("usage") or None


class ChunkTranslator:
    """Walks a chat stream for a translation: each choice's text, tool-call deltas and finish go to the
    subclass's handlers, which return the events to send; the usage chunk is kept."""
    usage: dict[str, Any] | None

    def start(self, model: str) -> list[dict[str, Any]]:
        """The opening events, once the stream's first chunk has said which model answers."""
        raise NotImplementedError

    def finish(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def on_text(self, text: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def on_reasoning(self, text: str) -> list[dict[str, Any]]:
        """A reasoning model's thinking (the chunk's ``reasoning_content``); it comes before the answer."""
        return []

    def on_call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def on_finish(self, reason: str, matched: Any) -> None:
        raise NotImplementedError

    def push(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        choices, usage = chunk_parts(chunk)
        self.usage = usage or self.usage
        events: list[dict[str, Any]] = []
        for choice in choices:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content") or delta.get("reasoning"):
                events += self.on_reasoning(delta.get("reasoning_content") or delta["reasoning"])
            if delta.get("content"):
                events += self.on_text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self.on_call(call)
            if choice.get("finish_reason"):
                self.on_finish(choice["finish_reason"], choice.get("stop_reason"))
        return events


async def translate(translator: ChunkTranslator, chunks: AsyncIterator[dict[str, Any]], model: str,
                    ) -> AsyncIterator[dict[str, Any]]:
    """A chat stream as the translator's events: start (named for the model the first chunk names), one
    push per chunk, finish."""
    started = False
    async for chunk in chunks:
        if not started:
            started = True
            if isinstance(chunk.get("usage"), dict):  # continuous usage stats: the prompt's tokens, before output
                translator.usage = chunk["usage"]
            for e in translator.start(chunk.get("model") or model):
                yield e
        for e in translator.push(chunk):
            yield e
    if not started:
        for e in translator.start(model):
            yield e
    for e in translator.finish():
        yield e


def finish_chat_request(chat: dict[str, Any], body: dict[str, Any],
                        response_format: dict[str, Any] | None) -> dict[str, Any]:
    """The fields both translations end a chat request with: the structured-output constraint (the API's own, or
    runlm's ``structured_outputs`` extension as chat completions takes it), and the daemon's ``keep_alive`` extra
    as the client sent it."""
    if response_format is not None:
        chat["response_format"] = response_format
    if "structured_outputs" in body:
        chat["structured_outputs"] = body["structured_outputs"]
    if "keep_alive" in body:
        chat["keep_alive"] = body["keep_alive"]
    return chat


@dataclass(slots=True, frozen=True)
class ErrorFields:
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None


def error_fields(exc: BaseException) -> ErrorFields | None:
    """The status and message of a server's error; None for an unexpected exception (a bug)."""
    status, message = getattr(exc, "status", None), getattr(exc, "message", None)
    if not isinstance(status, int) or not isinstance(message, str):
        return None
    return ErrorFields(status, message, getattr(exc, "param", None), getattr(exc, "code", None),
                       getattr(exc, "headers", None))


# the key a translation marks an image part with: where the client put the image, to name it in errors
CLIENT_PATH = "_client_path"


def image_paths(chat: dict[str, Any]) -> dict[str, str]:
    """Take the client's paths off the image parts of a translated chat request: {chat's path: the client's}
    (the server names an image it refuses by chat's path, ``messages[k].content[j]``)."""
    paths: dict[str, str] = {}
    for k, message in enumerate(chat.get("messages") or []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and CLIENT_PATH in part:
                paths[f"messages[{k}].content[{j}]"] = part.pop(CLIENT_PATH)
    return paths


def renamed(exc: BaseException, paths: dict[str, str]) -> BaseException:
    """``exc`` with an image part's path (its param, and its message's lead) said as the client sent it."""
    param = getattr(exc, "param", None)
    if not paths or not isinstance(param, str):
        return exc
    for chat_path, client_path in paths.items():
        if param == chat_path or param.startswith(chat_path + "."):
            exc.param = client_path + param[len(chat_path):]  # type: ignore[attr-defined]
            message = getattr(exc, "message", None)
            if isinstance(message, str):
                exc.message = message.replace(chat_path, client_path)  # type: ignore[attr-defined]
            break
    return exc


def bad_request(message: str, param: str | None = None) -> ProtocolError:
    return ProtocolError(400, message, param)


def model_of(body: dict[str, Any]) -> str:
    """The model a request names ('' when none: serve-engine answers with its own)."""
    model = body.get("model")
    return model if isinstance(model, str) else ""


@dataclass(slots=True)
class ChatStream:
    """Chat-completion chunks (the usage chunk last); ``close`` gives the request's resources back."""
    chunks: AsyncIterator[dict[str, Any]]
    close: Callable[[], Awaitable[None]]


class ChatSource(Protocol):
    async def complete(self, body: dict[str, Any]) -> dict[str, Any]: ...

    async def open_stream(self, body: dict[str, Any]) -> ChatStream: ...

    async def count_tokens(self, body: dict[str, Any]) -> int: ...


def chat_source(request: Request) -> ChatSource:
    """The app's source for this request (each app sets ``state.chat_source`` to a factory)."""
    factory: Callable[[Request], ChatSource] = request.app.state.chat_source
    return factory(request)


class ClosingStreamingResponse(StreamingResponse):
    """Closes the chat stream however the response ends, even if its body never starts."""

    def __init__(self, content: Any, stream: ChatStream, **kwargs: Any) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, **kwargs)
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.stream.close()


def named_event(name: str, payload: dict[str, Any]) -> str:
    """An SSE event with a name, as both Responses and Anthropic stream them."""
    return f"event: {name}\ndata: {sse_json(payload)}\n\n"
