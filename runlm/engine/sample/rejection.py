"""Verifying a draft: the target's logits at the last known token and at each draft token decide, row by
row, which draft tokens stand, and give one more token of the target's own (a correction or a bonus).

Greedy: a draft token stands while it equals the target's argmax, so the output is token for token the
output without speculation. Sampling: rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft
token d, drawn from q, stands with probability min(1, p(d) / q(d)); at the first rejection the token is
drawn from norm(max(p - q, 0)); so every token is distributed as the target's p. An n-gram draft is a
point mass (q(d) = 1). Each row's p is the target's after the request's penalties and grammar, computed
as if the draft tokens before it were already output.
"""
from __future__ import annotations

import numpy as np

from runlm.engine.core.sequence import Sequence
from runlm.engine.sample.sampler import (
    SampledToken,
    draw,
    log_softmax,
    probabilities,
    process_logits,
    processed_logprobs,
    sample_batch,
    token_logprobs,
    uniform,
)
from runlm.engine.structured.backend import StructuredOutputManager
from runlm.engine.types.outputs import Logprob

Verified = tuple[int, dict[int, Logprob] | None]


def verify_draft(raw: np.ndarray, seq: Sequence, structured: StructuredOutputManager | None) -> list[Verified]:
    """raw: [k + 1, V] float32 CPU logits for the rows of the last known token and the k draft tokens.
    Returns the accepted draft tokens plus the target's next token, each with its logprobs if asked."""
    draft, q = seq.spec.tokens, seq.spec.probs
    p = seq.params
    lps = log_softmax(raw) if p.logprobs is not None else None
    constrained = structured is not None and seq.seq_id in structured.seqs
    out: list[Verified] = []
    base = len(seq.token_ids)
    try:
        for j in range(len(draft) + 1):
            # rows after j see the accepted draft tokens as output: penalties, min_tokens and the grammar need that
            row = raw[j:j + 1].copy() if constrained else raw[j:j + 1]
            logits = process_logits(row, [p], [seq.token_ids[:seq.num_prompt_tokens]], [seq.output_token_ids],
                                    [seq.stop_ids])
            if constrained:
                assert structured is not None
                structured.mask_logits(logits, [seq])
            proposed = draft[j] if j < len(draft) else None
            if p.greedy:
                token = int(logits[0].argmax())
                accepted = token == proposed
            else:
                token, accepted = _rejection_step(probabilities(logits[0], p), proposed,
                                                  None if q is None or proposed is None else q[j], seq.generator)
            if constrained:
                assert structured is not None
                structured.accept([seq], [token])
            if lps is not None and p.logprobs_mode == "processed_logprobs":
                lps[j] = processed_logprobs(logits[0], p)
            out.append((token, token_logprobs(lps[j], token, p.logprobs) if lps is not None and p.logprobs is not None
                        else None))
            if not accepted or token in seq.stop_ids:
                break
            seq.token_ids.append(token)
    finally:
        del seq.token_ids[base:]  # the engine appends the tokens for real (stops, text) after the step
    return out


def _rejection_step(probs: np.ndarray, proposed: int | None, q: np.ndarray | None,
                    generator: np.random.Generator | None) -> tuple[int, bool]:
    """One row of rejection sampling: (token, whether it is the draft's). No draft token: a plain draw."""
    if proposed is None:
        return draw(probs, generator), False
    q_token = 1.0 if q is None else float(q[proposed])
    u = uniform(generator)
    if q_token > 0.0 and u * q_token < float(probs[proposed]):
        return proposed, True
    if q is None:
        residual = probs.copy()
        residual[proposed] = 0.0
    else:
        residual = np.maximum(probs - q, 0.0)
    if float(residual.sum()) <= 0.0:  # p == q to rounding: nothing left to correct
        residual = probs
    return draw(residual, generator), False


def spec_rows(spec_rows: list[int], spec_seqs: list[Sequence]) -> list[int]:
    """Every row of the speculating sequences (each its first row, then one per draft token)."""
    return [r + j for r, s in zip(spec_rows, spec_seqs) for j in range(len(s.spec.tokens) + 1)]


def sample_and_verify(raw: np.ndarray, sample_seqs: list[Sequence], spec_seqs: list[Sequence],
                      structured: StructuredOutputManager | None) -> list[SampledToken]:
    """A step's tokens from its logits ``raw``: one row per sampled sequence, then each speculating sequence's
    1 + k rows (verified). Both runners end their step here."""
    plain = len(sample_seqs)
    results = sample_batch(raw[:plain], sample_seqs, structured) if sample_seqs else []
    for seq in spec_seqs:
        k = len(seq.spec.tokens)
        results += [SampledToken(seq, t, lp) for t, lp in verify_draft(raw[plain:plain + k + 1], seq, structured)]
        plain += k + 1
    return results
