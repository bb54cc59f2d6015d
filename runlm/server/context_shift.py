"""Context shift, as llama-server's ``--context-shift`` and Ollama's ``shift``: a generation that fills the context
before its ``max_tokens`` goes on instead of stopping with ``length``.

When the engine ends a request at the context's end, the sequence so far (prompt and answer) keeps its first
``n_keep`` tokens (after a BOS) and loses half of the rest, the oldest first; a new engine request continues
from what is left, for the tokens still owed. Its outputs reach the client as the same answer (one stream, the
first request's prompt in the usage), so every route (chat, completions, Ollama's) gets it unchanged. The shifted
part is recomputed (a prefill of what is kept) rather than rotated in place as llama.cpp's K-shift does: slower
per shift, exact for every attention kind. A request with a structured-output constraint is not shifted (its
grammar's state would not survive), nor one asking for several choices.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from runlm.engine.types.outputs import RequestOutput
from runlm.engine.types.sampling_params import SamplingParams

MAX_SHIFTS = 1024  # a runaway generation still ends


def shifted(tokens: list[int], n_keep: int, bos: int | None) -> list[int]:
    """``tokens`` after one shift: the first ``n_keep`` (and a leading BOS) kept, half of the rest dropped from
    its start (llama-server's n_discard = n_left / 2)."""
    keep = n_keep + (1 if bos is not None and tokens[:1] == [bos] else 0)
    keep = min(keep, len(tokens) - 2)
    discard = max(1, (len(tokens) - keep) // 2)
    return tokens[:keep] + tokens[keep + discard:]


def shift_keep(req: Any, settings: Any) -> int | None:
    """A request's n_keep if its generation shifts the context (its ``context_shift``, else the server's
    --context-shift), None if it stops where the context ends."""
    on = req.context_shift if req.context_shift is not None else settings.context_shift
    return req.n_keep if on else None


def can_shift(params: SamplingParams) -> bool:
    return params.n == 1 and params.structured_outputs is None


class ShiftingStream:
    """A request stream (async iteration, ``close()``) that shifts the context when it fills. ``add`` adds an
    engine request (id, prompt ids, params) and returns its stream."""

    def __init__(self, add: Callable[[str, list[int], SamplingParams], Awaitable[Any]], first: Any,
                 request_id: str, prompt: list[int], params: SamplingParams, n_keep: int, bos: int | None) -> None:
        self.add, self.stream, self.request_id = add, first, request_id
        self.prompt, self.params, self.bos = prompt, params, bos
        # -1: the whole prompt (after its BOS, which every shift keeps anyway)
        self.n_keep = len(prompt) - (1 if bos is not None and prompt[:1] == [bos] else 0) if n_keep < 0 else n_keep
        self.tokens = list(prompt)
        self.generated = 0
        self.shifts = 0
        self.finished = False

    def __aiter__(self) -> ShiftingStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out: RequestOutput = await self.stream.__anext__()
        done = out.outputs[0] if out.outputs else None
        if done is not None:
            self.tokens += done.token_ids
            self.generated += len(done.token_ids)
        owed = None if self.params.max_tokens is None else self.params.max_tokens - self.generated
        if out.finished and done is not None and done.finish_reason == "length" and (owed is None or owed > 0) \
                and self.shifts < MAX_SHIFTS and len(self.tokens) > self.n_keep + 2:
            self.shifts += 1
            self.tokens = shifted(self.tokens, self.n_keep, self.bos)
            self.stream = await self.add(f"{self.request_id}-shift{self.shifts}", list(self.tokens),
                                         replace(self.params, max_tokens=owed, seed=None if self.params.seed is None
                                                 else self.params.seed + self.shifts))
            out = replace(out, finished=False, outputs=[replace(done, finish_reason=None, stop_reason=None)])
        elif out.finished:
            self.finished = True
        return replace(out, prompt_token_ids=self.prompt, request_id=self.request_id) if self.shifts else out

    def close(self) -> None:
        self.stream.close()

    async def aclose(self) -> None:
        self.close()
