"""From next-token logits to chosen tokens: per-request logits processing, sampling, logprobs.

numpy, not torch, so every runner shares it (the torch runner hands its float32 CPU logits over
without a copy; the native runner never imports torch). Every row has its own SamplingParams and,
when seeded, its own numpy Generator, so a request samples the same tokens whatever else is in the
batch. Greedy rows and rows without penalties cost no copy of the logits.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from runlm.engine.types.outputs import Logprob
from runlm.engine.types.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runlm.engine.core.sequence import Sequence
    from runlm.engine.structured.backend import StructuredOutputManager

_UNSEEDED = np.random.default_rng()  # draws for requests without a seed


@dataclass(slots=True)
class SampledToken:
    seq: Sequence
    token: int
    logprobs: dict[int, Logprob] | None


def make_generator(seed: int | None) -> np.random.Generator | None:
    return None if seed is None else np.random.Generator(np.random.PCG64(seed % 2**64))


def changes_logits(p: SamplingParams, num_output: int, stops: frozenset[int] | set[int]) -> bool:
    """Whether process_logits changes a row of this request after ``num_output`` output tokens."""
    return bool(p.logit_bias) or p.allowed_token_ids is not None or (num_output < p.min_tokens and bool(stops)) \
        or (p.repetition_penalty != 1.0 and p.penalty_last_n != 0) \
        or bool((p.presence_penalty or p.frequency_penalty) and num_output) \
        or (p.dry_multiplier > 0.0 and num_output > p.dry_allowed_length)


_DRY_MAX_EXPONENT = 40  # 1.75 ** 40 is already past any logit gap; keeps the penalty finite


def dry_penalties(output_ids: list[int], p: SamplingParams) -> dict[int, float]:
    """DRY over the generated tokens: for each token that would continue a sequence seen earlier in the output
    (its last k tokens equal the k tokens before an earlier occurrence of that token, k >= dry_allowed_length),
    the penalty for the longest such k. The prompt is never looked at, so an answer may quote it freely."""
    ctx = output_ids if p.dry_penalty_last_n < 0 else output_ids[-p.dry_penalty_last_n:] if p.dry_penalty_last_n \
        else []
    n = len(ctx)
    if n <= p.dry_allowed_length:
        return {}
    arr = np.asarray(ctx, dtype=np.int64)
    longest: dict[int, int] = {}
    for j in np.flatnonzero(arr[:n - 1] == arr[n - 1]).tolist():  # earlier places the last token was written
        k = 1
        while k <= j and arr[j - k] == arr[n - 1 - k]:
            k += 1
        if k >= p.dry_allowed_length:
            nxt = ctx[j + 1]
            longest[nxt] = max(longest.get(nxt, 0), k)
    return {t: p.dry_multiplier * p.dry_base ** min(k - p.dry_allowed_length, _DRY_MAX_EXPONENT)
            for t, k in longest.items()}


def penalized_tokens(prompt: Seq[int], output: Seq[int], last_n: int) -> set[int]:
    """The tokens repetition_penalty applies to: all of prompt and output, or the last ``last_n`` of them."""
    if last_n < 0:
        return set(prompt) | set(output)
    tail = list(output[-last_n:])
    if len(tail) < last_n:
        tail += list(prompt[len(prompt) - (last_n - len(tail)):])
    return set(tail)


def process_logits(logits: np.ndarray, params: Seq[SamplingParams], prompt_ids: Seq[list[int]],
                   output_ids: Seq[list[int]], stop_ids: Seq[frozenset[int] | set[int]]) -> np.ndarray:
    """Logit bias, allowed tokens, min_tokens, the three penalties and DRY, row by row (in place on a copy).
    Rows that need none of them (plain greedy, top-k/top-p sampling) cost no copy: ``logits`` itself
    comes back."""
    if not any(changes_logits(p, len(o), s) for p, o, s in zip(params, output_ids, stop_ids)):
        return logits
    logits = np.array(logits, dtype=np.float32)
    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        row = logits[i]
        if p.logit_bias:
            np.add.at(row, np.fromiter(p.logit_bias, np.int64), np.fromiter(p.logit_bias.values(), np.float32))
        if p.allowed_token_ids is not None:
            keep = np.full(vocab, -np.inf, dtype=np.float32)
            keep[np.asarray(p.allowed_token_ids, dtype=np.int64)] = 0.0
            row += keep
        if len(output_ids[i]) < p.min_tokens and stop_ids[i]:
            row[np.fromiter(stop_ids[i], np.int64)] = -np.inf
        if p.repetition_penalty != 1.0 and p.penalty_last_n != 0:
            seen = np.fromiter(penalized_tokens(prompt_ids[i], output_ids[i], p.penalty_last_n), np.int64)
            vals = row[seen]
            row[seen] = np.where(vals > 0, vals / np.float32(p.repetition_penalty),
                                 vals * np.float32(p.repetition_penalty))
        if (p.presence_penalty or p.frequency_penalty) and output_ids[i]:
            counts = np.bincount(np.asarray(output_ids[i], dtype=np.int64), minlength=vocab)[:vocab]
            row -= (np.float32(p.frequency_penalty) * counts + np.float32(p.presence_penalty) * (counts > 0)
                    ).astype(np.float32)
        if p.dry_multiplier > 0.0 and len(output_ids[i]) > p.dry_allowed_length:
            for tok, penalty in dry_penalties(output_ids[i], p).items():
                if tok < vocab:
                    row[tok] -= np.float32(penalty)
    return logits


def softmax(row: np.ndarray) -> np.ndarray:
    e = np.exp(row - row.max())
    return e / e.sum()


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """Row-wise log softmax in float32."""
    shifted = rows - rows.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def probabilities(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Temperature, top-n-sigma, top-k, typical-p, min-p and top-p on one row -> a probability vector (float32).
    Under mirostat only the temperature applies here: mirostat truncates by itself (``sample``)."""
    row = np.asarray(row, dtype=np.float32) / np.float32(p.temperature)
    if p.mirostat:
        return softmax(row)
    if p.top_n_sigma > 0.0:
        row = top_n_sigma(row, p.top_n_sigma)
    if p.top_k and p.top_k < row.shape[-1]:
        kth = np.partition(row, -p.top_k)[-p.top_k]
        row = np.where(row < kth, np.float32(-np.inf), row)
    probs = softmax(row)
    if p.typical_p < 1.0:
        probs = typical(probs, p.typical_p)
    if p.min_p > 0.0:
        probs = np.where(probs < np.float32(p.min_p) * probs.max(), np.float32(0.0), probs)
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order]
        drop = np.cumsum(sorted_probs) - sorted_probs > p.top_p  # smallest prefix reaching top_p
        probs = np.zeros_like(probs)
        probs[order] = np.where(drop, np.float32(0.0), sorted_probs)
    return probs


def top_n_sigma(row: np.ndarray, n: float) -> np.ndarray:
    """llama.cpp's top-n-sigma: logits below max - n * std (over the finite logits) are dropped."""
    finite = row[np.isfinite(row)]
    if finite.size < 2:
        return row
    cut = finite.max() - np.float32(n) * finite.std(dtype=np.float64)
    return np.where(row < cut, np.float32(-np.inf), row)


def typical(probs: np.ndarray, mass: float) -> np.ndarray:
    """Locally typical sampling (llama.cpp's typical_p): the tokens whose surprise is nearest the entropy, the
    fewest whose probability passes ``mass``; renormalized."""
    logp = np.log(np.maximum(probs, np.float32(1e-38)), dtype=np.float32)
    entropy = -np.sum(probs * logp, dtype=np.float64)
    shifted = np.where(probs > 0, np.abs(-logp - entropy), np.float32(np.inf))
    order = np.argsort(shifted, kind="stable")
    cum = np.cumsum(probs[order], dtype=np.float64)
    keep = min(int(np.searchsorted(cum, mass, side="right")) + 1, len(order))
    out = np.zeros_like(probs)
    out[order[:keep]] = probs[order[:keep]]
    return out / out.sum()


def exclude_top_choices(probs: np.ndarray, p: SamplingParams, generator: np.random.Generator | None) -> np.ndarray:
    """XTC (llama.cpp's): with chance xtc_probability, every token at or above xtc_threshold but the least likely
    of them is removed (nothing when fewer than two pass). Draws its coin from the request's generator."""
    if p.xtc_threshold > 0.5 or uniform(generator) > p.xtc_probability:
        return probs
    norm = probs / probs.sum()
    above = np.flatnonzero(norm >= np.float32(p.xtc_threshold))
    if above.size < 2:
        return probs
    out = probs.copy()
    out[above[norm[above] > norm[above].min()]] = 0.0  # (the least likely of them stays: never all zeros)
    return out


MIROSTAT_M = 100  # mirostat v1: the tokens its Zipf exponent is estimated from (llama.cpp's m)


def mirostat_draw(probs: np.ndarray, p: SamplingParams, seq: Sequence | None,
                  generator: np.random.Generator | None) -> int:
    """Mirostat v1 or v2 (llama.cpp's): truncate to a surprise target mu, draw, then move mu toward tau by eta
    times the surprise seen. mu lives on the sequence (2 * tau at its first token)."""
    mu = seq.mirostat_mu if seq is not None and seq.mirostat_mu is not None else 2.0 * p.mirostat_tau
    probs = probs.astype(np.float64) / probs.sum(dtype=np.float64)
    if p.mirostat == 2:
        surprise = -np.log2(np.maximum(probs, 1e-300))
        kept = np.where(surprise <= mu, probs, 0.0)
        if not kept.any():
            kept = np.where(probs == probs.max(), probs, 0.0)
    else:
        order = np.argsort(-probs, kind="stable")
        sp = np.maximum(probs[order], 1e-300)
        m = min(MIROSTAT_M, sp.size - 1)
        i = np.arange(m, dtype=np.float64)
        t = np.log((i + 2) / (i + 1))
        s_hat = float(np.sum(t * np.log(sp[:m] / sp[1:m + 1])) / np.sum(t * t)) if m else 1.0
        eps = s_hat - 1.0
        n = probs.size
        try:
            k = (eps * 2.0 ** mu / (1.0 - n ** -eps)) ** (1.0 / s_hat) if eps and s_hat > 0 else float(n)
        except (OverflowError, ZeroDivisionError):
            k = float(n)
        k = int(min(max(k if np.isfinite(k) else n, 1), n))
        kept = np.zeros_like(probs)
        kept[order[:k]] = probs[order[:k]]
    kept /= kept.sum()
    token = draw(kept, generator)
    if seq is not None:
        seq.mirostat_mu = mu - p.mirostat_eta * (-np.log2(kept[token]) - p.mirostat_tau)
    return token


def draw(probs: np.ndarray, generator: np.random.Generator | None) -> int:
    """One token from an unnormalized probability vector (zero entries are never drawn)."""
    cdf = np.cumsum(probs, dtype=np.float64)
    u = generator_or_unseeded(generator).random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), len(cdf) - 1))


def generator_or_unseeded(generator: np.random.Generator | None) -> np.random.Generator:
    """A request's generator, or the one unseeded requests share."""
    return generator or _UNSEEDED


def uniform(generator: np.random.Generator | None) -> float:
    return float(generator_or_unseeded(generator).random())


def sample(logits: np.ndarray, params: Seq[SamplingParams], generators: Seq[np.random.Generator | None],
           seqs: Seq[Sequence] | None = None) -> list[int]:
    """logits: [B, V], already processed. Returns B token ids. ``seqs`` hold mirostat's running targets."""
    out = logits.argmax(axis=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = probabilities(logits[i], p)
        if p.mirostat:
            out[i] = mirostat_draw(probs, p, seqs[i] if seqs is not None else None, generators[i])
            continue
        if p.xtc_probability > 0.0:
            probs = exclude_top_choices(probs, p, generators[i])
        out[i] = draw(probs, generators[i])
    return out


def token_logprobs(logprobs: np.ndarray, chosen: int, k: int) -> dict[int, Logprob]:
    """The chosen token's logprob and rank, plus the top k (vLLM's per-position dict)."""
    chosen_lp = float(logprobs[chosen])
    entry = {chosen: Logprob(chosen_lp, int((logprobs > chosen_lp).sum()) + 1)}
    if k:
        top = np.argpartition(-logprobs, k - 1)[:k] if k < logprobs.shape[-1] else np.arange(logprobs.shape[-1])
        top = top[np.argsort(-logprobs[top], kind="stable")]
        for rank, tid in enumerate(top.tolist(), start=1):
            entry.setdefault(tid, Logprob(float(logprobs[tid]), rank))
    return entry


def processed_logprobs(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution sampled from (vLLM's processed_logprobs): after bias, penalties, the grammar's mask and
    temperature, before top-k/top-p. Greedy rows are not divided by their zero temperature."""
    row = np.asarray(row, dtype=np.float32)
    return log_softmax(row if p.greedy else row / np.float32(p.temperature))


def sample_batch(raw: np.ndarray, seqs: list[Sequence],
                 structured: StructuredOutputManager | None) -> list[SampledToken]:
    """Penalties and bias, grammar masks, the draw, then logprobs: of the raw distribution (vLLM's default
    logprobs_mode), or of the processed one where the request asks.
    raw: [B, V] float32 logits of the sequences' last rows (not written)."""
    params = [s.params for s in seqs]
    trackers = [s.sync_thinking() for s in seqs]
    logits = process_logits(raw, params, [s.token_ids[:s.num_prompt_tokens] for s in seqs],
                            [s.output_token_ids for s in seqs], [s.stop_ids for s in seqs])
    if structured is not None and structured.seqs:
        if logits is raw:  # the mask writes in place; logprobs are reported from the unmasked logits
            logits = raw.copy()
        structured.mask_logits(logits, seqs)
    tokens = sample(logits, params, [s.generator for s in seqs], seqs)
    for i, tracker in enumerate(trackers):  # a spent thinking budget: the closing tag, a token a step
        forced = tracker.forced_token() if tracker is not None else None
        if forced is not None:
            tokens[i] = forced
    if structured is not None:
        structured.accept(seqs, tokens)
    lps: dict[int, np.ndarray] = {}  # row -> the logprobs it reports
    raw_rows = [i for i, p in enumerate(params) if p.logprobs is not None and p.logprobs_mode != "processed_logprobs"]
    if raw_rows:
        lps.update(zip(raw_rows, log_softmax(raw[raw_rows])))
    lps.update((i, processed_logprobs(logits[i], p)) for i, p in enumerate(params)
               if p.logprobs is not None and p.logprobs_mode == "processed_logprobs")
    return [SampledToken(seq, token, token_logprobs(lps[i], token, seq.params.logprobs)
                         if seq.params.logprobs is not None else None)
            for i, (seq, token) in enumerate(zip(seqs, tokens))]


def add_prompt_logprobs(seq: Sequence, logits: np.ndarray, first_pos: int) -> None:
    """Row j of ``logits`` predicts prompt position first_pos + j + 1; position 0 has no logprob."""
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None]
    lps = log_softmax(np.asarray(logits, dtype=np.float32))
    k = seq.params.prompt_logprobs
    assert k is not None
    for j in range(lps.shape[0]):
        seq.prompt_logprobs.append(token_logprobs(lps[j], seq.token_ids[first_pos + j + 1], k))
