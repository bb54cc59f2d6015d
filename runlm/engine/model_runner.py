"""Runs one scheduled batch through the model: flatten, forward, sample.

Owns the KV cache tensors (one K and one V tensor per layer, addressed by flat slot =
block * block_size + offset) and turns a SchedulerOutput into the model's forward context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runlm.engine.kv_cache import BlockManager
from runlm.engine.request import Logprob, Sequence
from runlm.engine.sampler import process_logits, sample, token_logprobs
from runlm.engine.scheduler import SchedulerOutput
from runlm.engine.structured.backend import StructuredOutputManager
from runlm.models.attention import ForwardContext, forward_context
from runlm.models.load import LoadedModel


@dataclass(slots=True)
class SampledToken:
    seq: Sequence
    token: int
    logprobs: dict[int, Logprob] | None


def kv_bytes_per_token(loaded: LoadedModel, dtype: torch.dtype) -> int:
    c = loaded.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, loaded: LoadedModel, blocks: BlockManager, dtype: torch.dtype, device: torch.device) -> None:
        self.loaded, self.blocks, self.dtype, self.device = loaded, blocks, dtype, device
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.structured: StructuredOutputManager | None = None  # the engine's grammar masks, if any
        self.allocate_kv_cache()

    def allocate_kv_cache(self) -> None:
        c = self.loaded.config
        shape = (len(self.blocks.blocks) * self.blocks.block_size, c.num_kv_heads, c.head_dim)
        # empty, not zeros: attention reads only slots already written, and untouched pages cost no RAM
        self.kv_caches = [(torch.empty(shape, dtype=self.dtype, device=self.device),
                           torch.empty(shape, dtype=self.dtype, device=self.device)) for _ in range(c.num_layers)]

    def free_kv_cache(self) -> None:
        self.kv_caches = []

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, stop_ids: dict[int, frozenset[int]]) -> list[SampledToken]:
        """Compute the scheduled tokens; sample for every sequence whose known tokens are now all computed."""
        ids, positions, slot_maps, context_slots, sample_rows, sample_seqs = [], [], [], [], [], []
        prompt_lp_rows: list[tuple[Sequence, int, int, int]] = []  # seq, first row, first position, count
        row = 0
        for seq, n in zip(sched.seqs, sched.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_ids[start:end])
            positions.append(torch.arange(start, end))
            slot_maps.append(self.blocks.slots(seq.table, start, end))
            context_slots.append(self.blocks.slots(seq.table, 0, end))
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1 \
                    and seq.num_preemptions == 0:
                last = min(end, seq.num_prompt_tokens - 1)
                prompt_lp_rows.append((seq, row, start, last - start))
            row += n
            if end == seq.num_tokens:
                sample_rows.append(row - 1)
                sample_seqs.append(seq)
        ctx = ForwardContext(list(sched.num_new_tokens), [s.num_computed_tokens + n for s, n in
                                                          zip(sched.seqs, sched.num_new_tokens)],
                             torch.cat(slot_maps).to(self.device), [c.to(self.device) for c in context_slots],
                             self.kv_caches)
        model = self.loaded.model
        with forward_context(ctx):
            hidden = model(torch.tensor(ids, device=self.device), torch.cat(positions).to(self.device))
        for seq, first_row, first_pos, count in prompt_lp_rows:
            self._prompt_logprobs(seq, model.compute_logits(hidden[first_row:first_row + count]).float().cpu(),
                                  first_pos)
        if not sample_seqs:
            return []
        raw = model.compute_logits(hidden[sample_rows]).float().cpu()
        params = [s.params for s in sample_seqs]
        logits = process_logits(raw, params, [s.token_ids[:s.num_prompt_tokens] for s in sample_seqs],
                                 [s.output_token_ids for s in sample_seqs], [stop_ids[s.seq_id] for s in sample_seqs])
        if self.structured is not None and self.structured.seqs:
            if logits is raw:  # the mask writes in place; logprobs are reported from the unmasked logits
                logits = raw.clone()
            self.structured.mask_logits(logits, sample_seqs)
        tokens = sample(logits, params, [s.generator for s in sample_seqs]).tolist()
        if self.structured is not None:
            self.structured.accept(sample_seqs, tokens)
        results = []
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        lps = torch.log_softmax(raw[want_lp], dim=-1) if want_lp else None
        for i, (seq, token) in enumerate(zip(sample_seqs, tokens)):
            entry = None
            if seq.params.logprobs is not None:
                entry = token_logprobs(lps[want_lp.index(i)], token, seq.params.logprobs)
            results.append(SampledToken(seq, token, entry))
        return results

    def _prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, first_pos: int) -> None:
        """Row j predicts prompt position first_pos + j + 1; position 0 has no logprob."""
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        lps = torch.log_softmax(logits, dim=-1)
        for j in range(lps.shape[0]):
            target = seq.token_ids[first_pos + j + 1]
            seq.prompt_logprobs.append(token_logprobs(lps[j], target, seq.params.prompt_logprobs))
