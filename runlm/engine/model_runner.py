"""Runs one scheduled batch through the model, in named phases (nano-vllm's and mini-sglang's order):

    prepare (flatten the batch into ids, positions and KV slots) -> run_model (the forward pass)
    -> prompt logprobs -> compute_logits -> sample (penalties, grammar masks, the draw, logprobs)

A speculating sequence brings its draft tokens after its last known token; its 1 + k rows are
verified (spec_decode_verify) instead of sampled, in the same forward pass as everything else.

Owns the KV cache tensors (one K and one V tensor per layer, addressed by flat slot =
block * block_size + offset) and turns a SchedulerOutput into the model's forward context.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from runlm.dtypes import torch_dtype
from runlm.engine.config import EngineConfig
from runlm.engine.kv_groups import AnyBlockManager, HybridBlockManager
from runlm.engine.outputs import Logprob
from runlm.engine.sampler import process_logits, sample, token_logprobs
from runlm.engine.scheduler import SchedulerOutput
from runlm.engine.sequence import Sequence
from runlm.engine.spec_decode_verify import verify_draft
from runlm.engine.structured.backend import StructuredOutputManager
from runlm.models.attention import ForwardContext, GroupSlots, forward_context
from runlm.models.load import LoadedModel


@dataclass(slots=True)
class SampledToken:
    seq: Sequence
    token: int
    logprobs: dict[int, Logprob] | None


@dataclass(slots=True)
class PromptLogprobRows:
    """Hidden rows ``first_row .. first_row + count`` predict prompt positions ``first_pos + 1 ..``."""
    seq: Sequence
    first_row: int
    first_pos: int
    count: int


@dataclass(slots=True)
class PreparedBatch:
    """A step's tokens flattened for one forward pass, and which rows to sample from."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    context: ForwardContext
    sample_rows: list[int] = field(default_factory=list)
    sample_seqs: list[Sequence] = field(default_factory=list)
    # speculating sequences: the first of their 1 + k rows (the last known token, then the draft tokens)
    spec_rows: list[int] = field(default_factory=list)
    spec_seqs: list[Sequence] = field(default_factory=list)
    prompt_logprob_rows: list[PromptLogprobRows] = field(default_factory=list)


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, blocks: AnyBlockManager,
                 structured: StructuredOutputManager | None = None) -> None:
        self.loaded, self.blocks, self.structured = loaded, blocks, structured
        self.dtype, self.device = torch_dtype(config.dtype), torch.device(config.device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.allocate_kv_cache()

    def allocate_kv_cache(self) -> None:
        c = self.loaded.config
        # empty, not zeros: attention reads only slots already written, and untouched pages cost no RAM
        self.kv_caches = []
        for layer in range(c.num_layers):
            shape = (self.blocks.layer_blocks(layer) * self.blocks.block_size, c.num_kv_heads, c.head_dim)
            self.kv_caches.append((torch.empty(shape, dtype=self.dtype, device=self.device),
                                   torch.empty(shape, dtype=self.dtype, device=self.device)))

    def free_kv_cache(self) -> None:
        self.kv_caches = []

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[SampledToken]:
        """Compute the scheduled tokens; sample for every sequence whose known tokens are now all computed."""
        batch = self.prepare(sched)
        hidden = self.run_model(batch)
        for rows in batch.prompt_logprob_rows:
            self._prompt_logprobs(rows, hidden)
        spec_rows = [r + j for r, s in zip(batch.spec_rows, batch.spec_seqs) for j in range(len(s.spec.tokens) + 1)]
        if not batch.sample_seqs and not spec_rows:
            return []
        raw = self.loaded.model.compute_logits(hidden[batch.sample_rows + spec_rows]).float().cpu()
        plain = len(batch.sample_rows)
        results = self.sample(raw[:plain], batch.sample_seqs) if batch.sample_seqs else []
        for seq in batch.spec_seqs:
            k = len(seq.spec.tokens)
            results += [SampledToken(seq, t, lp) for t, lp in verify_draft(raw[plain:plain + k + 1], seq,
                                                                           self.structured)]
            plain += k + 1
        return results

    def prepare(self, sched: SchedulerOutput) -> PreparedBatch:
        """Prefill chunks and decode tokens alike: each sequence contributes rows start..end."""
        ids: list[int] = []
        positions, slot_maps, context_slots = [], [], []
        hybrid = self.blocks if isinstance(self.blocks, HybridBlockManager) else None
        group_slots: list[list[tuple[np.ndarray, np.ndarray]]] = []  # per sequence: per extra group
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        spec_rows: list[int] = []
        spec_seqs: list[Sequence] = []
        lp_rows: list[PromptLogprobRows] = []
        row = 0
        for seq, n in zip(sched.seqs, sched.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_ids[start:end])
            num_draft = max(end - seq.num_tokens, 0)  # the scheduler trimmed the draft to what it scheduled
            ids.extend(seq.spec.tokens[:num_draft])
            positions.append(torch.arange(start, end))
            # the new tokens' slots are the tail of the context's: one lookup serves both
            context = self.blocks.slots(seq.table, 0, end)
            slot_maps.append(context[start:])
            context_slots.append(context)
            if hybrid is not None:
                group_slots.append([(c[start:], c) for c in hybrid.group_slots(seq.table, 0, end)])
            # a preempted sequence recomputes its prompt: its prompt logprobs are already there
            if seq.wants_prompt_logprobs and start < seq.num_prompt_tokens - 1 and seq.num_preemptions == 0:
                last = min(end, seq.num_prompt_tokens - 1)
                lp_rows.append(PromptLogprobRows(seq, row, start, last - start))
            row += n
            if num_draft:
                spec_rows.append(row - num_draft - 1)
                spec_seqs.append(seq)
            elif end == seq.num_tokens:
                sample_rows.append(row - 1)
                sample_seqs.append(seq)
        context_lens = [s.num_computed_tokens + n for s, n in zip(sched.seqs, sched.num_new_tokens)]
        # the block manager's slots are numpy int64: from_numpy shares their memory (no copy on CPU)
        ctx = ForwardContext(list(sched.num_new_tokens), context_lens, self.slot_tensor(np.concatenate(slot_maps)),
                             [self.slot_tensor(c) for c in context_slots], self.kv_caches)
        if hybrid is not None:
            ctx.layer_group = hybrid.layer_group
            ctx.groups = [GroupSlots(self.slot_tensor(np.concatenate([per[g][0] for per in group_slots])),
                                     [self.slot_tensor(per[g][1]) for per in group_slots])
                          for g in range(len(hybrid.groups) - 1)]
        return PreparedBatch(torch.tensor(ids, device=self.device), torch.cat(positions).to(self.device), ctx,
                             sample_rows, sample_seqs, spec_rows, spec_seqs, lp_rows)

    def slot_tensor(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(slots).to(self.device)

    def run_model(self, batch: PreparedBatch) -> torch.Tensor:
        with forward_context(batch.context):
            return self.loaded.model(batch.input_ids, batch.positions)

    def sample(self, raw: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        """Penalties and bias, grammar masks, the draw, then logprobs of the raw distribution (as vLLM)."""
        params = [s.params for s in seqs]
        logits = process_logits(raw, params, [s.token_ids[:s.num_prompt_tokens] for s in seqs],
                                [s.output_token_ids for s in seqs], [s.stop_ids for s in seqs])
        if self.structured is not None and self.structured.seqs:
            if logits is raw:  # the mask writes in place; logprobs are reported from the unmasked logits
                logits = raw.clone()
            self.structured.mask_logits(logits, seqs)
        tokens = sample(logits, params, [s.generator for s in seqs]).tolist()
        if self.structured is not None:
            self.structured.accept(seqs, tokens)
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        lps = torch.log_softmax(raw[want_lp], dim=-1) if want_lp else None
        results = []
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            entry = None
            if lps is not None and seq.params.logprobs is not None:
                entry = token_logprobs(lps[want_lp.index(i)], token, seq.params.logprobs)
            results.append(SampledToken(seq, token, entry))
        return results

    def _prompt_logprobs(self, rows: PromptLogprobRows, hidden: torch.Tensor) -> None:
        """Row j predicts prompt position first_pos + j + 1; position 0 has no logprob."""
        seq = rows.seq
        logits = self.loaded.model.compute_logits(hidden[rows.first_row:rows.first_row + rows.count]).float().cpu()
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        lps = torch.log_softmax(logits, dim=-1)
        k = seq.params.prompt_logprobs
        assert k is not None
        for j in range(lps.shape[0]):
            seq.prompt_logprobs.append(token_logprobs(lps[j], seq.token_ids[rows.first_pos + j + 1], k))
