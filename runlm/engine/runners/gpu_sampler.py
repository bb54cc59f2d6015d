"""The GPU runner's sampler: the numpy sampler's contract (runlm.engine.sample.sampler.sample_batch) computed on
the logits' device, with one host sync per step.

What it does on the device, row by row as the numpy sampler does: repetition, presence and frequency penalties;
greedy (argmax); temperature, top-k (ties with the k-th value kept), softmax, min-p, top-p (the smallest prefix
of the stably sorted probabilities reaching top_p); the draw; logprobs (of the raw distribution, or of the
processed one where a request asks), the chosen token's rank and the top k.

Seeded per request, the documented per-row scheme: the draw is inverse-CDF sampling with ONE uniform per row, and
that uniform comes from the sequence's own numpy Generator (``Sequence.generator``, seeded from the request's
seed), drawn on the host -- exactly the number the numpy sampler would draw. So a seeded request samples the
same tokens whatever else is in the batch, on either sampler, and a step that falls back to numpy keeps the
stream in step. Unseeded rows draw from one process-wide generator. The CDF is float64, as numpy's.

Structured outputs: the grammar's mask of each constrained row is computed on the host (the structured-output
manager's own mask_logits, applied to zeros: 0 where allowed, -inf where not) and uploaded as a boolean row.

Top-n-sigma, typical-p, XTC and mirostat v1/v2 run on the device too: XTC's coin and mirostat's running target mu
are the sequence's host state (the coin drawn from its generator before the draw's uniform, as the numpy sampler
draws it; mu uploaded with the step's knobs and moved on the host once the chosen token's probability comes back
with the step's one sync). Everything else falls back to the numpy sampler for that step, by name, logged once per
name: logit bias, allowed token ids, min_tokens (stop ids masked), DRY.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import numpy as np
import torch

from runlm.engine.sample import sampler as np_sampler
from runlm.engine.sample.sampler import SampledToken
from runlm.engine.types.outputs import Logprob

if TYPE_CHECKING:
    from runlm.engine.core.sequence import Sequence
    from runlm.engine.core.thinking import ThinkingTracker
    from runlm.engine.structured.backend import StructuredOutputManager
    from runlm.engine.types.sampling_params import SamplingParams

log = logging.getLogger("runlm.gpu")
_LOGGED: set[str] = set()


def fallback_reason(seqs: Seq[Sequence], structured: StructuredOutputManager | None) -> str | None:
    """Why this step's rows need the numpy sampler (None: the device sampler does them all)."""
    for s in seqs:
        p = s.params
        if p.logit_bias:
            return "logit_bias"
        if p.allowed_token_ids is not None:
            return "allowed_token_ids"
        if len(s.output_token_ids) < p.min_tokens and s.stop_ids:
            return "min_tokens"
        if p.dry_multiplier > 0.0:
            return "DRY"
    return None


def to_device(values: Seq[int] | Seq[float], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A small host list on the device without waiting for the stream: a plain ``torch.as_tensor(x, device=)``
    copies and then syncs, which would stall the host behind the step it just queued (async scheduling)."""
    return torch.as_tensor(values, dtype=dtype).to(device, non_blocking=True)


def _log_once(reason: str) -> None:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        log.info("the GPU sampler hands steps with %s to the numpy sampler (logged once)", reason)


def apply_penalties(logits: torch.Tensor, params: Seq[SamplingParams], prompt_ids: Seq[list[int]],
                    output_ids: Seq[list[int]]) -> torch.Tensor:
    """Repetition (over prompt and output), presence and frequency (over the output) penalties, on a copy where
    any row has one; ``logits`` itself where none has."""
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 and p.penalty_last_n != 0]
    pf = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty) and output_ids[i]]
    if not rep and not pf:
        return logits
    logits = logits.clone()
    vocab, dev = logits.shape[-1], logits.device
    for i in rep:  # seen tokens: divided where positive, multiplied where not
        seen = torch.as_tensor(np.fromiter(np_sampler.penalized_tokens(prompt_ids[i], output_ids[i],
                                                                       params[i].penalty_last_n), np.int64), device=dev)
        seen = seen[seen < vocab]
        vals = logits[i, seen]
        r = torch.tensor(params[i].repetition_penalty, dtype=torch.float32, device=dev)
        logits[i, seen] = torch.where(vals > 0, vals / r, vals * r)
    for i in pf:
        ids = torch.as_tensor(np.asarray(output_ids[i], dtype=np.int64), device=dev)
        ids = ids[ids < vocab]
        counts = torch.zeros(vocab, dtype=torch.float32, device=dev).index_add_(
            0, ids, torch.ones(ids.shape[0], dtype=torch.float32, device=dev))
        p = params[i]
        logits[i] -= counts * float(np.float32(p.frequency_penalty)) + (counts > 0).float() * float(
            np.float32(p.presence_penalty))
    return logits


def apply_grammar_masks(logits: torch.Tensor, raw: torch.Tensor, seqs: list[Sequence],
                        structured: StructuredOutputManager) -> torch.Tensor:
    """The grammar masks of the constrained rows, computed on the host and uploaded; a copy of the logits where
    they are still ``raw`` (logprobs of the raw distribution stay unmasked)."""
    rows = [i for i, s in enumerate(seqs) if s.seq_id in structured.seqs]
    if not rows:
        return logits
    bias = np.zeros((len(rows), logits.shape[-1]), dtype=np.float32)
    structured.mask_logits(bias, [seqs[i] for i in rows])
    banned = torch.from_numpy(np.isneginf(bias)).to(logits.device, non_blocking=True)
    if logits is raw:
        logits = logits.clone()
    idx = torch.as_tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(banned, float("-inf"))
    return logits


def probabilities(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, max_top_k: int, any_top_p: bool, n_sigma: torch.Tensor | None = None,
                  typical_p: torch.Tensor | None = None) -> torch.Tensor:
    """Temperature, top-n-sigma, top-k, softmax, typical-p, min-p, top-p on rows [B, V] -> probabilities (float32,
    zeros dropped), the numpy sampler's ``probabilities`` for every row at once. top_k 0 (or >= V), min_p 0,
    top_p 1, n_sigma <= 0, typical_p 1: off (None: off for every row). ``max_top_k`` (the largest top_k below V, 0
    if none) and ``any_top_p``: known on the host, so nothing syncs."""
    vocab = logits.shape[-1]
    rows = logits.float() / temperature[:, None]
    if n_sigma is not None:
        rows = _top_n_sigma(rows, n_sigma)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    if max_top_k:
        kmax = max_top_k
        top = torch.topk(rows, kmax, dim=-1).values
        kth = top.gather(1, (k - 1).clamp(max=kmax - 1)[:, None])
        rows = torch.where((k[:, None] < vocab) & (rows < kth), torch.tensor(float("-inf"), device=rows.device),
                           rows)
    probs = torch.softmax(rows, dim=-1)
    if typical_p is not None:
        probs = _typical(probs, typical_p)
    probs = torch.where(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0, probs)
    if any_top_p:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs > top_p[:, None]) & (top_p[:, None] < 1.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def request_probabilities(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """``probabilities`` for rows [B, V], row i with the knobs of ``params[i]`` (uploaded in one small copy; under
    mirostat only the temperature applies here)."""
    knobs = torch.tensor([[p.temperature, 0, 1.0, 0.0, 0.0, 1.0] if p.mirostat else
                          [p.temperature, p.top_k or 0, p.top_p, p.min_p, p.top_n_sigma, p.typical_p] for p in params],
                         dtype=torch.float32).to(logits.device, non_blocking=True)
    plain = [p for p in params if not p.mirostat]
    max_top_k = max((p.top_k for p in plain if p.top_k and 0 < p.top_k < logits.shape[-1]), default=0)
    return probabilities(logits, knobs[:, 0], knobs[:, 1].long(), knobs[:, 2], knobs[:, 3], max_top_k,
                         any(p.top_p < 1.0 for p in plain),
                         knobs[:, 4] if any(p.top_n_sigma > 0 for p in plain) else None,
                         knobs[:, 5] if any(p.typical_p < 1.0 for p in plain) else None)


def _top_n_sigma(rows: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Logits below max - n * std of the row's finite logits dropped, where n > 0 (the numpy top_n_sigma)."""
    finite = torch.isfinite(rows)
    vals = torch.where(finite, rows, 0.0).double()
    count = finite.sum(dim=-1, keepdim=True).clamp(min=1)
    mean = vals.sum(dim=-1, keepdim=True) / count
    var = (torch.where(finite, vals - mean, 0.0) ** 2).sum(dim=-1, keepdim=True) / count
    top = torch.where(finite, rows, float("-inf")).max(dim=-1, keepdim=True).values
    cut = top.double() - n[:, None].double() * var.sqrt()
    on = (n[:, None] > 0) & (count > 1)
    return torch.where(on & (rows.double() < cut), float("-inf"), rows)


def _typical(probs: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling on rows where mass < 1 (the numpy typical): renormalized."""
    logp = torch.log(probs.clamp(min=1e-38))
    entropy = -(probs * logp).double().sum(dim=-1, keepdim=True)
    shifted = torch.where(probs > 0, (-logp.double() - entropy).abs(), float("inf"))
    _, order = torch.sort(shifted, dim=-1, stable=True)
    sorted_probs = probs.gather(1, order)
    cum = sorted_probs.double().cumsum(dim=-1)
    keep = torch.searchsorted(cum, mass[:, None].double().contiguous(), right=True) + 1  # [B, 1]
    pos = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    kept = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(pos >= keep, 0.0))
    kept = kept / kept.sum(dim=-1, keepdim=True)
    return torch.where(mass[:, None] < 1.0, kept, probs)


def exclude_top_choices(probs: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """XTC on rows whose coin came up (the numpy exclude_top_choices): every token at or above the row's threshold
    but the least likely of them removed, where two or more pass."""
    norm = probs / probs.sum(dim=-1, keepdim=True)
    above = norm >= threshold[:, None]
    least = torch.where(above, norm, float("inf")).min(dim=-1, keepdim=True).values
    drop = above & (norm > least) & (above.sum(dim=-1, keepdim=True) >= 2)
    return probs.masked_fill(drop, 0.0)


MIROSTAT_M = np_sampler.MIROSTAT_M


def mirostat_kept(probs: torch.Tensor, mu: torch.Tensor, version: torch.Tensor) -> torch.Tensor:
    """Mirostat's truncation (the numpy mirostat_draw before its draw) on rows [B, V] of softmax(logits / T):
    v2 keeps the tokens whose surprise (-log2 p) is at most mu (the likeliest if none is), v1 the k likeliest
    with k from the Zipf exponent of the top MIROSTAT_M; float64, renormalized."""
    p = probs.double()
    p = p / p.sum(dim=-1, keepdim=True)
    n = p.shape[-1]
    surprise = -torch.log2(p.clamp(min=1e-300))
    v2 = torch.where(surprise <= mu[:, None], p, 0.0)
    v2 = torch.where(v2.sum(dim=-1, keepdim=True) > 0, v2, torch.where(p == p.max(dim=-1, keepdim=True).values, p, 0.0))
    sorted_p, order = torch.sort(p, dim=-1, descending=True, stable=True)
    sp = sorted_p.clamp(min=1e-300)
    m = min(MIROSTAT_M, n - 1)
    if m:
        i = torch.arange(m, dtype=torch.float64, device=p.device)
        t = torch.log((i + 2) / (i + 1))
        s_hat = (t * torch.log(sp[:, :m] / sp[:, 1:m + 1])).sum(dim=-1) / (t * t).sum()
    else:
        s_hat = torch.ones(p.shape[0], dtype=torch.float64, device=p.device)
    eps = s_hat - 1.0
    k = (eps * 2.0 ** mu / (1.0 - float(n) ** -eps)) ** (1.0 / s_hat)
    k = torch.where((eps != 0) & (s_hat > 0) & torch.isfinite(k), k, float(n))
    k = k.clamp(1, n).floor()
    pos = torch.arange(n, device=p.device)[None, :]
    v1 = torch.zeros_like(p).scatter_(1, order, sorted_p.masked_fill(pos >= k[:, None], 0.0))
    kept = torch.where(version[:, None] == 2, v2, v1)
    return kept / kept.sum(dim=-1, keepdim=True)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: row i takes the token where its float64 CDF passes uniforms[i] * total (numpy's draw)."""
    cdf = probs.double().cumsum(dim=-1)
    target = (uniforms * cdf[:, -1])[:, None].contiguous()
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]
    return idx.clamp(max=probs.shape[-1] - 1)


def _row_logprobs(lps: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Per row: the chosen token's logprob, its rank, and the top k (values, ids)."""
    chosen_lp = lps.gather(1, chosen[:, None])[:, 0]
    rank = (lps > chosen_lp[:, None]).sum(dim=-1) + 1
    if k:
        vals, ids = torch.topk(lps, min(k, lps.shape[-1]), dim=-1, sorted=True)
    else:
        vals, ids = lps[:, :0], torch.zeros((lps.shape[0], 0), dtype=torch.int64, device=lps.device)
    return chosen_lp, rank, vals, ids


class SampleLaunch:
    """A step's draws queued on the device: ``tokens`` [B] (the drawn ids, on the device: the next step's inputs
    may read them before the host does) and ``result()``, which waits for them (the step's one sync) and hands
    out the SampledTokens. A step the numpy sampler took is done at once (``tokens`` None)."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor | None,
                 finish: Callable[[], list[SampledToken]]) -> None:
        self.seqs, self.tokens, self._finish = seqs, tokens, finish
        self._done: list[SampledToken] | None = None

    @classmethod
    def done(cls, sampled: list[SampledToken]) -> SampleLaunch:
        return cls([s.seq for s in sampled], None, lambda: sampled)

    def result(self) -> list[SampledToken]:
        if self._done is None:
            self._done = self._finish()
        return self._done


def sample_on_device(raw: torch.Tensor, seqs: list[Sequence],
                     structured: StructuredOutputManager | None) -> list[SampledToken]:
    """raw: [B, V] logits on the device (not written). The numpy sampler's results, computed on the device."""
    return launch_sample(raw, seqs, structured).result()


def launch_sample(raw: torch.Tensor, seqs: list[Sequence],
                  structured: StructuredOutputManager | None) -> SampleLaunch:
    """``sample_on_device``'s work queued on the device; its host half (the sync, mirostat's mu, forced tokens,
    the grammar's accept, the logprob entries) runs when the launch's result is asked for."""
    reason = fallback_reason(seqs, structured)
    if reason is not None:
        _log_once(reason)
        return SampleLaunch.done(np_sampler.sample_batch(raw.float().cpu().numpy(), seqs, structured))
    dev = raw.device
    params = [s.params for s in seqs]
    trackers = [s.sync_thinking() for s in seqs]
    raw = raw.float()
    logits = apply_penalties(raw, params, [s.token_ids[:s.num_prompt_tokens] for s in seqs],
                             [s.output_token_ids for s in seqs])
    if structured is not None and structured.seqs:
        logits = apply_grammar_masks(logits, raw, seqs, structured)
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    mirostat: tuple[list[Sequence], torch.Tensor] | None = None
    if sampled:
        sel = to_device(sampled, dev)
        sp = [params[i] for i in sampled]
        coins, draws = [], []
        for i in sampled:  # each row's uniforms in the numpy sampler's order: XTC's coin, then the draw's
            p, gen = params[i], seqs[i].generator
            xtc = p.xtc_probability > 0.0 and not p.mirostat and p.xtc_threshold <= 0.5
            coins.append(np_sampler.uniform(gen) <= p.xtc_probability if xtc else False)
            draws.append(np_sampler.uniform(gen))
        uniforms = to_device(draws, dev, torch.float64)
        probs = request_probabilities(logits[sel], sp)
        xtc_rows = [j for j, c in enumerate(coins) if c]
        if xtc_rows:
            xtc_idx = to_device(xtc_rows, dev)
            cut = to_device([sp[j].xtc_threshold for j in xtc_rows], dev, torch.float32)
            probs = probs.index_copy(0, xtc_idx, exclude_top_choices(probs[xtc_idx], cut))
        miro_rows = [j for j, p in enumerate(sp) if p.mirostat]
        final = probs.double()
        if miro_rows:
            miro_idx = to_device(miro_rows, dev)
            state = torch.tensor([[_mu(seqs[sampled[j]]), sp[j].mirostat] for j in miro_rows], dtype=torch.float64)
            state = state.to(dev, non_blocking=True)
            final = final.index_copy(0, miro_idx, mirostat_kept(probs[miro_idx], state[:, 0], state[:, 1]))
        tokens[sel] = draw(final, uniforms)
        if miro_rows:  # the chosen token's kept probability moves mu (on the host, after the sync)
            chosen_p = final[miro_idx].gather(1, tokens[sel][miro_idx][:, None])[:, 0]
            mirostat = ([seqs[sampled[j]] for j in miro_rows], chosen_p)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    lp_parts: tuple[torch.Tensor, ...] = ()
    kmax = 0
    if want:
        kmax = max(params[i].logprobs or 0 for i in want)
        rows = []
        for i in want:
            p = params[i]
            if p.logprobs_mode == "processed_logprobs":
                rows.append(logits[i] if p.greedy else logits[i] / float(np.float32(p.temperature)))
            else:
                rows.append(raw[i])
        lps = torch.log_softmax(torch.stack(rows), dim=-1)
        lp_parts = _row_logprobs(lps, tokens[to_device(want, dev)], kmax)
    # every result on its way to the host; the step's one sync waits for them
    moved = (tokens, *lp_parts, *((mirostat[1],) if mirostat else ()))
    host = [t.to("cpu", non_blocking=dev.type == "cuda") for t in moved]
    copied = torch.cuda.Event() if dev.type == "cuda" else None
    if copied is not None:
        copied.record()

    # the step's [B, V] logits are kept only where a thinking budget may force a token (its logprobs come from
    # them): a step left running must not hold a second step's worth of logits beside the next one's
    kept = (raw, logits) if any(t is not None for t in trackers) else None

    def finish() -> list[SampledToken]:
        if copied is not None:
            copied.synchronize()
        return _host_results(host, seqs, params, trackers, kept, want, mirostat, structured)

    return SampleLaunch(seqs, tokens, finish)


def _host_results(host: list[torch.Tensor], seqs: list[Sequence], params: list[SamplingParams],
                  trackers: list[ThinkingTracker | None], kept: tuple[torch.Tensor, torch.Tensor] | None,
                  want: list[int], mirostat: tuple[list[Sequence], torch.Tensor] | None,
                  structured: StructuredOutputManager | None) -> list[SampledToken]:
    """The host half of a step's sampling, once its results have arrived."""
    if mirostat is not None:
        for seq, chosen in zip(mirostat[0], host[-1].tolist()):
            p = seq.params
            seq.mirostat_mu = _mu(seq) - p.mirostat_eta * (-np.log2(chosen) - p.mirostat_tau)
        host = host[:-1]
    drawn: list[int] = host[0].tolist()
    out_tokens = list(drawn)
    for i, tracker in enumerate(trackers):
        forced = tracker.forced_token() if tracker is not None else None
        if forced is not None:
            out_tokens[i] = forced
    if structured is not None:
        structured.accept(seqs, out_tokens)
    entries: dict[int, dict[int, Logprob]] = {}
    if want:
        chosen_lp, rank, vals, ids = (h.tolist() for h in host[1:])
        for j, i in enumerate(want):
            if out_tokens[i] != drawn[i]:  # a token the thinking budget forced: its logprobs on the host
                assert kept is not None  # (a forced token has a tracker)
                entries[i] = _forced_entry(*kept, i, params[i], out_tokens[i])
                continue
            entry = {out_tokens[i]: Logprob(chosen_lp[j], int(rank[j]))}
            k = params[i].logprobs or 0
            for r, (tid, v) in enumerate(zip(ids[j][:k], vals[j][:k]), start=1):
                entry.setdefault(tid, Logprob(v, r))
            entries[i] = entry
    return [SampledToken(seq, tok, entries.get(i)) for i, (seq, tok) in enumerate(zip(seqs, out_tokens))]


def _mu(seq: Sequence) -> float:
    """Mirostat's running target (2 * tau at a sequence's first token)."""
    return seq.mirostat_mu if seq.mirostat_mu is not None else 2.0 * seq.params.mirostat_tau


def _forced_entry(raw: torch.Tensor, logits: torch.Tensor, i: int, p: SamplingParams,
                  token: int) -> dict[int, Logprob]:
    """Logprobs of a token the thinking budget forced, the numpy way (rare: once per request)."""
    if p.logprobs_mode == "processed_logprobs":
        lps = np_sampler.processed_logprobs(logits[i].cpu().numpy(), p)
    else:
        lps = np_sampler.log_softmax(raw[i:i + 1].cpu().numpy())[0]
    return np_sampler.token_logprobs(lps, token, p.logprobs or 0)
