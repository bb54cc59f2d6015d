"""``/v1/tokenize``, ``/v1/detokenize``, ``/v1/count_tokens`` (also at the root, as vLLM serves them)."""
from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse

from runlm.server.body import parse_body
from runlm.server.errors import bad_request
from runlm.server.logprobs import TokenTexts
from runlm.server.prompts import chat_prompt_ids
from runlm.server.protocol import DetokenizeRequest, TokenizeRequest
from runlm.server.state import ServerState
from runlm.web.openapi import json_body

router = APIRouter()


async def _tokens(request: Request) -> tuple[TokenizeRequest, list[int], int, ServerState]:
    state: ServerState = request.app.state.server
    req = await parse_body(request, TokenizeRequest)
    state.check_model(req.model)
    engine = state.ready_engine()
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        if not req.messages:
            raise bad_request("messages must not be empty", "messages")
        ids = await chat_prompt_ids(engine, req.messages, req.add_generation_prompt, req.tools,
                                    req.chat_template_kwargs, state.settings.trust_request_chat_template,
                                    media=state.settings.media, model=state.model_name)
    else:
        assert req.prompt is not None  # exactly one of the two, checked above
        ids = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return req, ids, engine.max_model_len, state


@router.post("/v1/tokenize", openapi_extra=json_body(TokenizeRequest))
@router.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
async def tokenize(request: Request) -> JSONResponse:
    req, ids, max_len, state = await _tokens(request)
    body = {"count": len(ids), "max_model_len": max_len, "tokens": ids}
    if req.return_token_strs:
        texts = TokenTexts(state.ready_engine().tokenizer)
        body["token_strs"] = [texts.get(i)[0] for i in ids]
    return JSONResponse(body)


@router.post("/v1/count_tokens", openapi_extra=json_body(TokenizeRequest))
async def count_tokens(request: Request) -> JSONResponse:
    _, ids, max_len, _ = await _tokens(request)
    return JSONResponse({"count": len(ids), "input_tokens": len(ids), "max_model_len": max_len})


@router.post("/v1/detokenize", openapi_extra=json_body(DetokenizeRequest))
@router.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
async def detokenize(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    req = await parse_body(request, DetokenizeRequest)
    state.check_model(req.model)
    tok = state.ready_engine().tokenizer
    bad = next((t for t in req.tokens if not 0 <= t < tok.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (size {tok.vocab_size})", "tokens")
    return JSONResponse({"prompt": tok.decode(req.tokens)})
