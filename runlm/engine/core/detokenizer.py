"""After sampling, per request: detokenize incrementally, find stop tokens and stop strings, and build
the RequestOutputs to hand out (whole, delta or final only)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from runlm.engine.core.sequence import Sequence
from runlm.engine.types.outputs import CompletionOutput, RequestMetrics, RequestOutput
from runlm.formats.tokenizer import IncrementalDetokenizer, Tokenizer

# vLLM's RequestOutputKind: every output carries everything so far, only what is new, or one final output.
CUMULATIVE, DELTA, FINAL_ONLY = "cumulative", "delta", "final_only"


@dataclass(slots=True)
class SeqText:
    """Streaming text of one sequence; text that could still become a stop string is held back."""
    detok: IncrementalDetokenizer
    text: str = ""
    sent_chars: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    texts: list[SeqText]
    output_kind: str = CUMULATIVE
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    sent_final: bool = False

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def new_request_state(request_id: str, prompt: str | None, prompt_ids: list[int], seqs: list[Sequence],
                      tokenizer: Tokenizer, output_kind: str) -> RequestState:
    texts = [SeqText(IncrementalDetokenizer(tokenizer, prompt_ids, s.params.skip_special_tokens)) for s in seqs]
    return RequestState(request_id, prompt, prompt_ids, seqs, texts, output_kind)


def append_token(state: RequestState, index: int, token: int) -> str | None:
    """Add a sampled token to sequence ``index``; returns the finish reason if it ends the sequence."""
    seq, st = state.seqs[index], state.texts[index]
    p = seq.params
    seq.token_ids.append(token)
    if seq.first_token_time is None:
        seq.first_token_time = time.monotonic()
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = seq.first_token_time
    if token in seq.stop_ids and seq.num_output_tokens > p.min_tokens:
        seq.stop_reason = token if token in p.stop_token_ids else None
        st.text += st.detok.flush()
        return "stop"
    before = len(st.text)
    st.text += st.detok.push(token)
    if p.stop and seq.num_output_tokens > p.min_tokens:
        longest = max(map(len, p.stop))
        window_start = max(0, before - longest + 1)
        hit = None
        for s in p.stop:
            pos = st.text.find(s, window_start)
            if pos != -1 and (hit is None or pos < hit[0]):
                hit = (pos, s)
        if hit is not None:
            pos, s = hit
            st.text = st.text[:pos + len(s)] if p.include_stop_str_in_output else st.text[:pos]
            seq.stop_reason = s
            return "stop"
    if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
        st.text += st.detok.flush()
        return "length"
    return None


def _visible_chars(st: SeqText, seq: Sequence) -> int:
    """How much text is safe to stream: hold back a tail that may start a stop string."""
    if seq.is_finished or not seq.params.stop:
        return len(st.text)
    return max(st.sent_chars, len(st.text) - (max(map(len, seq.params.stop)) - 1))


def make_output(state: RequestState) -> RequestOutput | None:
    """The RequestOutput to hand out now, or None when the kind says to wait (final_only, nothing new)."""
    finished = state.finished
    if state.output_kind == FINAL_ONLY and not finished:
        return None
    if state.sent_final:
        return None
    outputs = []
    any_new = False
    for seq, st in zip(state.seqs, state.texts):
        upto = _visible_chars(st, seq)
        tokens = seq.output_token_ids
        if state.output_kind == DELTA:
            text, ids = st.text[st.sent_chars:upto], tokens[st.sent_tokens:]
            lps = seq.logprobs[st.sent_logprobs:] if seq.logprobs is not None else None
        else:
            text, ids, lps = st.text[:upto], list(tokens), list(seq.logprobs) if seq.logprobs is not None else None
        any_new |= bool(ids) or upto > st.sent_chars or seq.is_finished
        st.sent_chars, st.sent_tokens = upto, len(tokens)
        st.sent_logprobs = len(seq.logprobs or [])
        outputs.append(CompletionOutput(seq.index, text, ids,
                                        seq.cumulative_logprob if seq.params.logprobs is not None else None,
                                        lps, seq.finish_reason, seq.stop_reason))
    if not any_new and not finished:
        return None
    if finished:
        state.sent_final = True
        state.metrics.finished_time = time.monotonic()
    prompt_lps = state.seqs[0].prompt_logprobs
    return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, prompt_lps, outputs, finished,
                         max(state.seqs[0].num_cached_tokens, 0), state.metrics)
