"""Speculative decoding's verification on the GPU runner's device: the numpy verifier's contract
(runlm.engine.sample.rejection.verify_draft) without copying a speculating sequence's 1 + k rows of logits to the
host (a 150k-token vocabulary: 0.6 MB a row, at 64 sequences and k = 5 some 230 MB a step).

Every row is worked on at once: greedy rows take their argmax; sampled rows their probabilities (the device
sampler's, runlm.engine.runners.gpu_sampler), draft token d_j stands where u_j * q(d_j) < p(d_j) (q = 1 for an
n-gram's point mass, else the draft model's row), and each row also draws the token it would give at a rejection
(from max(p - q, 0), or p without d_j for an n-gram; p where that is empty) or, past the last draft token, the
bonus (from p). One sync brings back per row whether its draft token stands and the token it would draw; the host
walks each sequence's rows as verify_draft does (to the first rejection or stop token).

Seeded streams stay in step with the numpy verifier: the uniforms are drawn on the host from the sequence's own
generator in the order verify_draft would consume them (u_0, u_1, ... then the draw's), k + 2 of them from a copy
of its state; the generator then moves on by exactly the number the walk used. So a seeded request gives the same
tokens verified here or on the host.

Rows whose logits depend on the tokens accepted before them (penalties, min_tokens, DRY, logit bias, allowed ids),
structured outputs, logprobs, mirostat and XTC keep the host verifier (those sequences' rows alone are copied)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from runlm.engine.runners.gpu_sampler import draw, request_probabilities, sample_on_device
from runlm.engine.sample import sampler as np_sampler
from runlm.engine.sample.rejection import Verified, verify_draft
from runlm.engine.sample.sampler import SampledToken, changes_logits

if TYPE_CHECKING:
    from runlm.engine.core.sequence import Sequence
    from runlm.engine.structured.backend import StructuredOutputManager
    from runlm.engine.types.sampling_params import SamplingParams


def host_reason(seq: Sequence, structured: StructuredOutputManager | None) -> str | None:
    """Why a speculating sequence's draft is verified on the host (None: on the device)."""
    p, k, done = seq.params, len(seq.spec.tokens), len(seq.output_token_ids)
    if structured is not None and seq.seq_id in structured.seqs:
        return "structured outputs"
    if p.logprobs is not None:
        return "logprobs"
    if p.mirostat or p.xtc_probability > 0.0:
        return "mirostat or XTC"
    if changes_logits(p, done, seq.stop_ids) or changes_logits(p, done + k, seq.stop_ids):
        return "logits that depend on the tokens accepted before them"
    return None


def sample_and_verify_on_device(raw: torch.Tensor, sample_seqs: list[Sequence], spec_seqs: list[Sequence],
                                structured: StructuredOutputManager | None) -> list[SampledToken]:
    """runlm.engine.sample.rejection.sample_and_verify for logits ``raw`` on the device: one row per sampled
    sequence, then each speculating sequence's 1 + k rows."""
    plain = len(sample_seqs)
    results = sample_on_device(raw[:plain], sample_seqs, structured) if sample_seqs else []
    starts, row = [], plain
    for seq in spec_seqs:
        starts.append(row)
        row += len(seq.spec.tokens) + 1
    device = [(s, r) for s, r in zip(spec_seqs, starts) if host_reason(s, structured) is None]
    verified = dict(zip((id(s) for s, _ in device), verify_on_device(raw, device))) if device else {}
    for seq, start in zip(spec_seqs, starts):
        got = verified.get(id(seq))
        if got is None:
            k = len(seq.spec.tokens)
            got = verify_draft(raw[start:start + k + 1].float().cpu().numpy(), seq, structured)
        results += [SampledToken(seq, t, lp) for t, lp in got]
    return results


def verify_on_device(raw: torch.Tensor, seqs: list[tuple[Sequence, int]]) -> list[list[Verified]]:
    """Each (sequence, its first row in ``raw``)'s accepted draft tokens and the target's next token."""
    dev = raw.device
    rows = [r + j for s, r in seqs for j in range(len(s.spec.tokens) + 1)]
    logits = raw[torch.as_tensor(rows, device=dev)].float()
    draft = torch.tensor([t for s, _ in seqs for t in (*s.spec.tokens, 0)], dtype=torch.int64).to(dev)
    has_draft = torch.tensor([j < len(s.spec.tokens) for s, _ in seqs for j in range(len(s.spec.tokens) + 1)]
                             ).to(dev)
    drawn = logits.argmax(dim=-1)  # (greedy rows: the target's token, and whether the draft's equals it)
    stands = drawn == draft
    sampled = [i for i, (s, _) in enumerate(seqs) if not s.params.greedy]
    states: list[tuple[np.random.Generator, Mapping[str, Any]]] = []
    if sampled:
        sel_rows: list[int] = []
        params: list[SamplingParams] = []
        accept_u: list[float] = []
        draw_u: list[float] = []
        qs: list[np.ndarray | None] = []
        first = 0
        firsts = []
        for s, _ in seqs:
            firsts.append(first)
            first += len(s.spec.tokens) + 1
        for i in sampled:
            s, k = seqs[i][0], len(seqs[i][0].spec.tokens)
            gen = np_sampler.generator_or_unseeded(s.generator)
            states.append((gen, gen.bit_generator.state))
            u = [gen.random() for _ in range(k + 2)]
            sel_rows += range(firsts[i], firsts[i] + k + 1)
            params += [s.params] * (k + 1)
            accept_u += [*u[:k], 0.0]
            draw_u += [*u[1:k + 1], u[k]]  # a rejection at j draws with u_{j+1}; the bonus row with u_k
            qs.append(s.spec.probs)
        sel = torch.as_tensor(sel_rows, device=dev)
        probs = request_probabilities(logits[sel], params)
        d, real = draft[sel], has_draft[sel]
        p_d = probs.gather(1, d[:, None])[:, 0].double()
        without_d = probs.scatter(1, d[:, None], 0.0)  # an n-gram's residual: p without its point mass
        q = _draft_rows(qs, [len(seqs[i][0].spec.tokens) for i in sampled], probs.shape[-1], dev)
        if q is None:
            q_d, residual = torch.ones_like(p_d), without_d
        else:  # (q = 1 at d on an n-gram's rows: _draft_rows marks them)
            point = q[:, 0] < 0
            q_d = torch.where(point, 1.0, q.gather(1, d[:, None])[:, 0].double())
            residual = torch.where(point[:, None], without_d, (probs - q).clamp(min=0.0))
        coins = torch.tensor(accept_u, dtype=torch.float64).to(dev)
        stands[sel] = real & (q_d > 0) & (coins * q_d < p_d)
        residual = torch.where(real[:, None], residual, probs)  # (the bonus row: p)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
        drawn[sel] = draw(residual, torch.tensor(draw_u, dtype=torch.float64).to(dev))
    host_stands, host_drawn = stands.cpu().tolist(), drawn.cpu().tolist()  # (the one sync)
    out: list[list[Verified]] = []
    used: dict[int, int] = {}
    first = 0
    for i, (s, _) in enumerate(seqs):
        k = len(s.spec.tokens)
        tokens: list[Verified] = []
        consumed = 0
        for j in range(k + 1):
            accepted = j < k and host_stands[first + j]
            token = s.spec.tokens[j] if accepted else host_drawn[first + j]
            consumed += 1 if accepted or j == k else 2
            tokens.append((token, None))
            if not accepted or token in s.stop_ids:
                break
        used[i] = consumed
        out.append(tokens)
        first += k + 1
    for (gen, state), i in zip(states, sampled):  # each generator moved on by what the walk used
        gen.bit_generator.state = state
        for _ in range(used[i]):
            gen.random()
    return out


def _draft_rows(qs: list[np.ndarray | None], ks: list[int], vocab: int, dev: torch.device) -> torch.Tensor | None:
    """The draft model's probabilities as rows beside the target's (zeros on bonus rows; -1 in the first column of
    an n-gram sequence's rows, a point mass); None: every sequence's draft is an n-gram's."""
    if all(q is None for q in qs):
        return None
    rows = []
    for q, k in zip(qs, ks):
        block = np.zeros((k + 1, vocab), dtype=np.float32)
        if q is not None:
            block[:k, :q.shape[-1]] = q[:k, :vocab]
        else:
            block[:k, 0] = -1.0
        rows.append(block)
    return torch.from_numpy(np.concatenate(rows)).to(dev)
